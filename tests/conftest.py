import concurrent.futures
import importlib.util
import multiprocessing
import os
import subprocess

import pytest
import torch

from tests.training.conftest import REPO, SEQ_LENGTH, VOCAB

# Triton kernels run on the CPU through the interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile'd pieces of megatron-core (e.g. the gated norm) compile once per test session, not per test.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))
# make test runs two pytest-xdist workers on a 2-core machine: each takes one core for its in-process tests, as the
# ranks its tests launch do (OMP_NUM_THREADS=1), instead of both spinning two threads on the same two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` need the vLLM environment; elsewhere they skip with the command that builds it."""
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="needs vLLM: run in .venv-vllm (make venv-vllm; make test runs them there)")
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    from data_prep.midtrain import build

    out = tmp_path_factory.mktemp("data") / "chitchat-tiny"
    build(output=str(out), seq_length=SEQ_LENGTH, max_conversations=300, vocab_size=VOCAB, progress=False)
    return out


def _random_hf_checkpoint(directory, preset_name: str):
    from megatron_mimesis.models.presets import get_preset

    torch.manual_seed(0)
    preset = get_preset(preset_name).replace(vocab_size=VOCAB)
    preset.family.hf_model(preset).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    return _random_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tiny", "tiny")


@pytest.fixture(scope="session")
def qwen3_hf_checkpoint(tmp_path_factory):
    """The tiny Qwen3 (a Qwen3ForCausalLM), at random."""
    return _random_hf_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3-tiny", "qwen3-tiny")


@pytest.fixture(scope="session")
def qwen3_tokenizer(tiny_dataset, tmp_path_factory):
    """The tiny dataset's tokenizer carrying Qwen3's released chat template (tests/fixtures), as a Qwen3 checkpoint's
    tokenizer carries it: what a Qwen3 agent's contexts are rendered with."""
    import shutil

    out = tmp_path_factory.mktemp("tokenizers") / "qwen3"
    shutil.copytree(tiny_dataset / "tokenizer", out)
    shutil.copy2(REPO / "tests" / "fixtures" / "qwen3_chat_template.jinja", out / "chat_template.jinja")
    return out


@pytest.fixture(scope="session")
def _slurm_session(tmp_path_factory):
    from tests.slurm_cluster import start_cluster

    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm_cluster(_slurm_session):
    """A private SLURM cluster of 4 nodes x 2 CPUs (tests/slurm_cluster.py), shared by the tests of this process;
    whatever jobs a test leaves (one that failed mid-chain) are cancelled after it, so the next test's jobs do not
    wait behind them for nodes."""
    from tests.slurm_cluster import cancel_every_job

    yield _slurm_session
    cancel_every_job(_slurm_session)


@pytest.fixture
def checkout_untouched():
    """Fails the test, after it ran, when ``git status`` of the checkout changed: a benchmark or tool run by the
    test wrote into the repository (tracked or unignored files) instead of its ``--output`` or ``runs/``."""

    def status() -> str:
        return subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True,
                              check=True).stdout

    before = status()
    yield
    assert status() == before, "the test changed the checkout (git status differs)"


@pytest.fixture(scope="session")
def planner():
    """A process for the memory-plan tests: spawned, so it has no process group (the plan builds its own fake worlds,
    which this process's other tests may not allow), and shared, so its plans' measurements are made once."""
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool
