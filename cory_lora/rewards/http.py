"""A reward served over HTTP: the completions are POSTed as JSON to `reward.url`.

Request (one per `reward.batch_size` completions), `Content-Type: application/json`:

    {"prompts": [str, ...], "completions": [str, ...], "columns": {"answer": [...], ...}}

Answer: HTTP 200 with a JSON list of numbers (or null: no score for that one), one per
completion, or an object `{"rewards": [...]}` holding that list.

A timeout, a refused or lost connection (also one dropped in the middle of the answer: a
reset, or an answer cut short of its Content-Length), HTTP 408, 429 and 5xx are tried again
`reward.retries` times, waiting 1 s, 2 s, 4 s, ... in between; any other failure is final at
once. JSON `null` is "no score" (as None), and the values are judged as any reward's are:
null, NaN (`NaN` is read), inf or a number beyond float32 are named for what they are.
Failures raise `RewardError` naming the URL and the HTTP status. Standard library only (urllib).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

from cory_lora.errors import RewardError

RETRY_WAIT_S = 1.0  # the first wait between attempts; doubled after each
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class _Retry(Exception):
    """A failure worth another attempt (the message says what happened)."""


def http_reward(
    prompts: list[str],
    completions: list[str],
    url: str,
    batch_size: int = 64,
    timeout_s: float = 60.0,
    retries: int = 2,
    **columns,
) -> list[float | None]:
    """Rewards from the server at `url`, `batch_size` completions per request."""
    rewards: list[float | None] = []
    for start in range(0, len(completions), batch_size):
        window = slice(start, start + batch_size)
        payload = {
            "prompts": list(prompts[window]),
            "completions": list(completions[window]),
            "columns": {name: list(values[window]) for name, values in columns.items()},
        }
        rewards += post_for_rewards(url, payload, timeout_s, retries)
    return rewards


def post_for_rewards(url: str, payload: dict, timeout_s: float, retries: int) -> list:
    """POST one batch and return its rewards, trying again after transient failures."""
    # default=str: a dataset column of dates (say) is sent as text rather than failing here
    body = json.dumps(payload, ensure_ascii=False, default=str).encode("utf-8")
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    wait = RETRY_WAIT_S
    for attempt in range(retries + 1):
        try:
            text = _send(request, url, timeout_s)
            break
        except _Retry as e:
            if attempt == retries:
                tries = f"{retries + 1} attempt{'s' if retries else ''}"
                raise RewardError(
                    f"{e} (gave up after {tries}; reward.retries = {retries})"
                ) from None
            time.sleep(wait)
            wait *= 2
    return _rewards(text, url, len(payload["completions"]))


def _send(request: urllib.request.Request, url: str, timeout_s: float) -> str:
    """The answer's text; _Retry for what may pass, RewardError for what will not."""
    where = f"reward.url = {url!r}"
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        detail = _snippet(e.read().decode("utf-8", errors="replace"))
        message = f"{where} answered HTTP {e.code} {e.reason}" + (f": {detail}" if detail else "")
        if e.code in RETRIED_STATUSES:
            raise _Retry(message) from None
        raise RewardError(message) from None
    except TimeoutError:
        raise _Retry(f"{where} did not answer within reward.timeout_s = {timeout_s:g} s") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, TimeoutError):
            raise _Retry(
                f"{where} did not answer within reward.timeout_s = {timeout_s:g} s"
            ) from None
        raise _Retry(f"{where}: cannot connect ({reason})") from None
    except OSError as e:  # reset or closed mid-answer
        raise _Retry(f"{where}: the connection failed ({e or type(e).__name__})") from None
    except http.client.HTTPException as e:  # an answer cut short (IncompleteRead), a bad status
        what = type(e).__name__
        raise _Retry(f"{where}: the connection was lost mid-answer ({what}: {e})") from None


def _rewards(text: str, url: str, expected: int) -> list:
    where = f"reward.url = {url!r}"
    try:
        data = json.loads(text)
    except ValueError:
        raise RewardError(
            f"{where} answered HTTP 200 with something that is not JSON: {_snippet(text)!r}"
        ) from None
    if isinstance(data, dict) and "rewards" in data:
        data = data["rewards"]
    if not isinstance(data, list):
        raise RewardError(
            f"{where} answered {_snippet(text)!r}; expected a JSON list of numbers or "
            '{"rewards": [...]}'
        )
    if len(data) != expected:
        raise RewardError(f"{where} answered {len(data)} rewards for {expected} completions")
    return data


def _snippet(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
