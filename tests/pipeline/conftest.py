import pytest


@pytest.fixture(scope="session")
def pipeline_data(tmp_path_factory):
    """One data_prep output of the demo's mid-training data for the pipeline tests, given to each run
    (``--given midtrain_data=DIR``)."""
    from data_prep.midtrain import build

    out = tmp_path_factory.mktemp("pipeline-data") / "data"
    build(output=str(out), seq_length=256, vocab_size=8192, max_conversations=400, progress=False)
    return out
