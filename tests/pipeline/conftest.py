import pytest


@pytest.fixture(scope="session")
def pipeline_data(tmp_path_factory):
    """One data_prep output of the demo's mid-training data for the pipeline tests, given to each run
    (``--given midtrain_data=DIR``)."""
    from data_prep.midtrain import build

    out = tmp_path_factory.mktemp("pipeline-data") / "data"
    build(output=str(out), seq_length=256, vocab_size=8192, max_conversations=400, progress=False)
    return out


@pytest.fixture(scope="session")
def demo_vocab_export(pipeline_data, tmp_path_factory):
    """The tiny Qwen3.5 at random, at the demo data's vocabulary, exported as a user would (``tools/convert_checkpoint.py
    export``: its tokenizer, the simulator's chat template): what a pipeline is given in place of an export (``kind:
    input``), to serve or to start agent RL from."""
    from megatron_mimesis.checkpoint.conversion import import_from_hf
    from megatron_mimesis.models.presets import get_preset
    from tests.exports import export

    work = tmp_path_factory.mktemp("demo-vocab-export")
    preset = get_preset("tiny").replace(vocab_size=8192)
    preset.family.hf_model(preset).save_pretrained(work / "random")
    import_from_hf(work / "random", work / "mcore", dtype="fp32", progress=False)
    return export(work / "mcore", work / "hf", pipeline_data / "tokenizer")
