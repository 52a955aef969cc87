"""``python -m sglang_kda.launch_router``: SGLang's router, after a check of a PD deployment.

Takes ``sglang_router.launch_router``'s arguments unchanged. In PD mode (``--pd-disaggregation``)
it first reads every ``--prefill`` and ``--decode`` server's ``/server_info`` and compares, for
each prefill/decode pair the router may form, the settings that decide what the transferred KV
pages and KDA states mean (:data:`sglang_kda.pd_check.MUST_AGREE`). On a difference it exits with
status 2 and a message naming the flag, both values and both servers, before any request is
routed: a PD deployment with mismatched flags fails at start. Otherwise (and outside PD mode)
it becomes the router (``exec``), with the same arguments.

A decode server cannot do this itself: it does not know its prefill servers until a request
pairs them. It still checks each prefill server at that first request
(``patches/disaggregation_conn.py``), which covers routers started without this launcher and
servers added later.

Its own flags (taken out before the router sees the rest):

* ``--kda-pd-check-timeout S`` (default 600): how long to wait for each server's
  ``/server_info`` (servers started beside the router are still loading). A server that does
  not answer in time is named in a warning and its pairs go unchecked here (the router then
  waits for it as usual);
* ``--kda-pd-check off``: skip the check.

A plain module: it imports neither SGLang nor torch (the router starts in well under a second
more than without it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from sglang_kda import pd_check

ROUTER = "sglang_router.launch_router"
TIMEOUT_FLAG, CHECK_FLAG = "--kda-pd-check-timeout", "--kda-pd-check"


def split_args(argv: Sequence[str]) -> tuple[list[str], float, bool]:
    """(the router's arguments, the check's timeout, whether to check)."""
    rest, timeout, check = [], 600.0, True
    it = iter(argv)
    for a in it:
        flag, eq, value = a.partition("=")
        if flag in (TIMEOUT_FLAG, CHECK_FLAG):
            value = value if eq else next(it, None)
            if value is None:
                sys.exit(f"sglang_kda.launch_router: {flag} needs a value")
            if flag == TIMEOUT_FLAG:
                try:
                    timeout = float(value)
                except ValueError:
                    sys.exit(f"sglang_kda.launch_router: {flag} {value!r}: not a number")
            elif value in ("on", "off"):
                check = value == "on"
            else:
                sys.exit(f"sglang_kda.launch_router: {flag} {value!r}: expected on or off")
        else:
            rest.append(a)
    return rest, timeout, check


def pd_servers(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """The prefill and decode URLs of a PD router's arguments ([], [] outside PD mode)."""
    if "--pd-disaggregation" not in args:
        return [], []
    prefill, decode = [], []
    for i, a in enumerate(args):
        if a in ("--prefill", "--decode") and i + 1 < len(args):
            (prefill if a == "--prefill" else decode).append(args[i + 1])
        elif a.startswith(("--prefill=", "--decode=")):
            flag, _, url = a.partition("=")
            (prefill if flag == "--prefill" else decode).append(url)
    return prefill, decode


def read_server_info(url: str, timeout: float, sleep: float = 1.0) -> Optional[dict]:
    """A server's ``/server_info``, waiting up to ``timeout`` s for it to answer."""
    import requests

    deadline = time.monotonic() + timeout
    while True:
        try:
            r = requests.get(url.rstrip("/") + "/server_info", timeout=10)
            if r.status_code == 200:
                return r.json()
        except requests.RequestException:
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(sleep)


def _ssm_default(info: dict) -> str:
    """The state dtype a server takes without ``--mamba-ssm-dtype``: its model config's, when
    the model path is readable here, else SGLang's float32."""
    config = Path(str(info.get("model_path") or "")) / "config.json"
    try:
        return pd_check.model_ssm_dtype(json.loads(config.read_text()))
    except (OSError, ValueError):
        return "float32"


def check(
    prefill: Sequence[str],
    decode: Sequence[str],
    info_of: Callable[[str], Optional[dict]],
) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a PD deployment: one error per mismatched prefill/decode pair,
    naming the flags and both values; one warning per server that did not answer."""
    infos = {url: info_of(url) for url in [*prefill, *decode]}
    warnings = [
        f"{url} did not answer /server_info: its pairs are checked at their first request"
        for url, info in infos.items()
        if info is None
    ]
    errors = []
    for d in decode:
        if infos[d] is None:
            continue
        ssm = _ssm_default(infos[d])
        ours = pd_check.transfer_settings(infos[d], ssm)
        for p in prefill:
            if infos[p] is None:
                continue
            lines = pd_check.mismatches(pd_check.transfer_settings(infos[p], ssm), ours)
            if lines:
                errors.append(f"prefill {p} and decode {d}: {'; '.join(lines)}")
    return errors, warnings


def main(argv: Optional[Sequence[str]] = None) -> None:
    args, timeout, enabled = split_args(sys.argv[1:] if argv is None else argv)
    prefill, decode = pd_servers(args)
    if enabled and prefill and decode:
        errors, warnings = check(prefill, decode, lambda url: read_server_info(url, timeout))
        for w in warnings:
            print(f"sglang_kda.launch_router: warning: {w}", file=sys.stderr, flush=True)
        if errors:
            print(
                "sglang_kda.launch_router: these PD servers differ on flags that must agree for "
                "the KV and KDA state transfer (docs/scale-out.md, PD):\n  "
                + "\n  ".join(errors)
                + "\nStart both sides with the same values. (--kda-pd-check off skips this check;"
                " requests through a mismatched pair then fail at their handshake.)",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(2)
        print(
            f"sglang_kda.launch_router: {len(prefill)} prefill x {len(decode)} decode servers "
            "agree on the transfer's flags",
            file=sys.stderr,
            flush=True,
        )
    os.execv(sys.executable, [sys.executable, "-m", ROUTER, *args])


if __name__ == "__main__":
    main()
