"""CSD pieces: the coach's inputs, the teacher context (identical tokens, only the note added), dropped notes,
gate statistics, and the combined loss gradient = GRPO + alpha * CSD computed separately."""

import math

import pytest
import torch
from megatron_mimesis.kernels import fused_linear_policy_loss

from megatron_mimesis.rl.agent.agent_chat import PiecewiseAgentChat
from megatron_mimesis.rl.agent.csd import (
    COACH_TEMPLATE,
    NO_GATE,
    OpenAICoach,
    ScriptedCoach,
    coach_prompt,
    gate_statistics,
    placebo_corrected,
    teacher_context,
)
from megatron_mimesis.rl.agent.episodes import AgentEpisodeRunner
from megatron_mimesis.rl.envs.toy import ToySuite, code_of, toy_user
from megatron_mimesis.rl.types import SamplingParams
from tests.rl.fakes import IM_END, FakeOpenAIServer, ScriptedEngine, char_tokenizer, ids

SUITE = ToySuite(num_tasks=2, max_words=3, seed=0)
ITEM = SUITE.items[0]


def _episode():
    tokenizer = char_tokenizer()
    chat = PiecewiseAgentChat(tokenizer, thinking=False)
    engine = ScriptedEngine(tokenizer, [["Sorry, I cannot help with that today."], [f"It is {code_of(ITEM)}"]])
    runner = AgentEpisodeRunner(engine, chat, toy_user(), SamplingParams(), max_agent_turns=3)
    return runner.run(SUITE, ["toy-0"], rollouts_per_task=1, step_seed=0)[0], chat


def test_coach_sees_history_message_and_the_users_private_reaction():
    episode, chat = _episode()
    prompt = coach_prompt(chat, episode, 0, COACH_TEMPLATE.read_text())
    assert f"[user] Hi, what is the code for {ITEM}?" in prompt
    assert "## The agent's message\nSorry, I cannot help with that today." in prompt
    assert f"That was not the code for {ITEM}; I need just the number, briefly." in prompt  # z_t
    assert f"## The user's next message\nPlease, what is the code for {ITEM}?" in prompt  # x_{t+1}
    last = coach_prompt(chat, episode, 1, COACH_TEMPLATE.read_text())
    assert "## The user's private thoughts after it\nI got my code." in last


def test_teacher_scores_the_identical_tokens_after_a_context_that_only_adds_the_note():
    episode, chat = _episode()
    for t, turn in enumerate(episode.turns):
        teacher = teacher_context(chat, episode, t, "Give the code.")
        end_of_system = turn.context_ids.index(IM_END)
        assert teacher == (turn.context_ids[:end_of_system] + ids("\n\n# Coach's note\nGive the code.")
                           + turn.context_ids[end_of_system:])
    # and the student's context is exactly what the agent was sampled from: no note anywhere
    assert all("Coach" not in chat.tokenizer.decode(turn.context_ids) for turn in episode.turns)


def test_coach_failures_are_reported_not_invented():
    coach = ScriptedCoach(lambda prompt: None if "message\nSorry" in prompt else "<think>hmm</think>Be brief.")
    episode, chat = _episode()
    notes = coach.notes_many([coach_prompt(chat, episode, t, COACH_TEMPLATE.read_text()) for t in range(2)])
    assert notes[0].note is None and notes[0].error == "scripted failure"
    assert notes[1].note == "Be brief."  # the coach's own thinking is not part of the note
    with FakeOpenAIServer() as server:
        server.broken = True
        result = OpenAICoach(server.base_url, "coach", max_retries=0).notes_many(["x"])[0]
    assert result.note is None and "InternalServerError" in result.error
    with FakeOpenAIServer(reply=lambda messages: "   ") as server:
        assert OpenAICoach(server.base_url, "coach").notes_many(["x"])[0].error == "empty note"


def test_placebo_correction_removes_the_generic_shift_of_any_note():
    student = [-1.0, -2.0, -0.5]
    placebo = [-0.8, -1.9, -0.4]  # any note makes the teacher a little more confident...
    teacher = [-0.8, -0.9, -0.4]  # ...this one also favours the second token
    corrected = placebo_corrected(teacher, placebo, student)
    assert corrected == pytest.approx([-1.0, -1.0, -0.5])  # only the note's content moves the gate
    gates = gate_statistics([corrected], [student], beta=5.0)
    assert gates["csd_logprob_gap_mean"] == pytest.approx(1.0 / 3)


def test_gate_statistics_by_hand_skip_dropped_turns():
    stats = gate_statistics([[-1.0, -2.0], [NO_GATE]], [[-1.0, -1.0], [-0.5]], beta=5.0)
    gate = 1 / (1 + math.exp(5.0))  # teacher 1 nat below the student on the second token
    assert stats["csd_tokens"] == 2
    assert stats["csd_gate_mean"] == pytest.approx((0.5 + gate) / 2)
    assert stats["csd_gate_open_frac"] == 0.0 and stats["csd_logprob_gap_mean"] == pytest.approx(-0.5)
    assert gate_statistics([[-800.0]], [[0.0]], beta=5.0)["csd_gate_mean"] == 0.0  # no overflow


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_combined_gradient_is_grpo_plus_alpha_csd_computed_separately(impl):
    torch.manual_seed(0)
    n, h, v, alpha, beta = 12, 16, 40, 0.01, 5.0
    hidden = torch.randn(n, h, dtype=torch.float64)
    weight = torch.randn(v, h, dtype=torch.float64) * 0.3
    targets = torch.randint(0, v, (n,))
    mask = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0], dtype=torch.float64)
    old = (torch.log_softmax(hidden @ weight.t(), -1).gather(1, targets[:, None]).squeeze(1) + 0.1 * torch.randn(n))
    advantages = torch.randn(n, dtype=torch.float64)
    teacher = old + torch.randn(n, dtype=torch.float64)
    teacher[6:9] = NO_GATE  # a turn whose coach failed: its CSD term is dropped

    def grad(fn):
        h_, w_ = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        fn(h_, w_).backward()
        return h_.grad, w_.grad

    combined = grad(lambda h_, w_: fused_linear_policy_loss(
        h_, w_, targets, mask, old, advantages, teacher_logprobs=teacher, csd_alpha=alpha, csd_beta=beta,
        impl=impl)[0])
    grpo = grad(lambda h_, w_: fused_linear_policy_loss(h_, w_, targets, mask, old, advantages, impl=impl)[0])

    def csd(h_, w_):  # -mean(g * log p) over loss tokens, g = sigmoid(beta * stopgrad(teacher - log p))
        logp = torch.log_softmax(h_ @ w_.t(), -1).gather(1, targets[:, None]).squeeze(1)
        gate = torch.sigmoid(beta * (teacher - logp.detach()))
        return -(gate * logp * mask).sum() / mask.sum()

    separate = grad(csd)
    for c, g, s in zip(combined, grpo, separate, strict=True):
        assert torch.isfinite(c).all()
        assert torch.allclose(c, g + alpha * s, rtol=1e-5, atol=1e-7)
        assert not torch.allclose(c, g, rtol=1e-9, atol=1e-12)  # the CSD term does contribute
    rows_without_note = grad(lambda h_, w_: fused_linear_policy_loss(
        h_, w_, targets, mask, old, advantages, teacher_logprobs=teacher, csd_alpha=alpha, impl=impl)[0])[0][6:9]
    assert torch.allclose(rows_without_note, grpo[0][6:9], rtol=1e-6, atol=1e-9)
