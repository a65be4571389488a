"""Ask every endpoint a run will call once, before it trains.

An RL run calls models over HTTP: agent RL its user model and its coach, simulator RL its counterpart and its LLM
judge. One that does not answer (a config still naming ``http://COACH_HOST:8000/v1``, a server not yet up, a key it
refuses) fails every request of the run, and the run trains on as something else: without CSD, with every episode an
error, with no judge reward. So each is asked for its model list (``GET {base_url}/models``, what ``vllm serve`` and
every OpenAI-compatible server answer cheaply) by the launchers' pre-check before ``srun`` (``--dry-run
--check-endpoints``) and again by rank 0 as the run starts, and one that does not answer, or does not serve the
configured model, refuses the run in one line naming the config field and the URL.
"""

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from megatron_mimesis.training.config import ConfigError

ASK_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Endpoint:
    field: str  # the config field that names it, e.g. "coach_options"
    base_url: str
    model: str
    api_key: str | None = None

    @classmethod
    def from_options(cls, field: str, options: dict) -> "Endpoint":
        return cls(field, str(options["base_url"]), str(options["model"]), options.get("api_key"))


def ask(endpoint: Endpoint, timeout_s: float = ASK_TIMEOUT_S) -> None:
    """Raise ConfigError unless ``endpoint`` answers its model list with its model in it."""
    url = endpoint.base_url.rstrip("/") + "/models"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {endpoint.api_key or 'EMPTY'}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            served = [entry.get("id") for entry in json.load(response).get("data", [])]
    except urllib.error.HTTPError as error:
        hint = " (its api_key?)" if error.code in (401, 403) else ""
        raise ConfigError(f"{endpoint.field}: {url} answered HTTP {error.code}{hint}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise ConfigError(f"{endpoint.field}: {url} did not answer ({reason}); the run would call it at every "
                          f"step") from None
    except (ValueError, AttributeError):
        raise ConfigError(f"{endpoint.field}: {url} did not answer an OpenAI model list") from None
    if endpoint.model not in served:
        raise ConfigError(f"{endpoint.field}: {endpoint.base_url} serves {served}, not the model {endpoint.model!r}")


def check_endpoints(endpoints: list[Endpoint]) -> None:
    """Each endpoint once (one URL and model asked once however many fields name it)."""
    asked = set()
    for endpoint in endpoints:
        key = (endpoint.base_url, endpoint.model, endpoint.api_key)
        if key not in asked:
            ask(endpoint)
            asked.add(key)
