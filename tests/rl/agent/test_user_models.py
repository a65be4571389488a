"""The OpenAI user model speaks the user-simulator convention (what tau2's UserSimulator sends and the export's
chat template renders back into the training roles): the scenario as system, the agent as user, its own earlier
turns as assistant; the reply is its next turn, thinking kept private."""

from megatron_mimesis.rl.agent.user_models import OpenAIUserModel
from tests.rl.fakes import FakeOpenAIServer

TRANSCRIPT = [{"role": "assistant", "content": "Hi! How can I help?"}, {"role": "user", "content": "my code please"},
              {"role": "assistant", "content": "Which item?"}]


def test_the_request_is_flipped_and_the_reply_is_the_users_turn():
    with FakeOpenAIServer(reply=lambda messages: "<think>\nsay it\n</think>\n\nalpha <END>") as server:
        (reply,) = OpenAIUserModel(server.base_url, "sim").reply_many(["You want the code for alpha."], [TRANSCRIPT])
    (request,) = server.requests
    assert request["messages"] == [{"role": "system", "content": "You want the code for alpha."},
                                   {"role": "user", "content": "Hi! How can I help?"},
                                   {"role": "assistant", "content": "my code please"},
                                   {"role": "user", "content": "Which item?"}]
    assert (reply.thinking, reply.utterance, reply.done, reply.error) == ("say it", "alpha", True, None)
