"""Fetching a model from the Hugging Face Hub into its cache: which files (plan_download, never
.bin/.pth/onnx duplicates), then huggingface_hub's resumable downloads with progress bars.
huggingface_hub is imported only here, and only when a download is needed."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.errors import KilnError, ModelNotFoundError
from kiln.i18n import msg
from kiln.resolve.hf_cache import cached_snapshot, hf_cache_dir
from kiln.resolve.local import ModelSource, not_found, source_from_dir
from kiln.resolve.picker import glob_escape, group_gguf, pick_gguf_group, safetensors_names

# Files besides weights a safetensors model needs (tokenizer, chat template, generation config).
_AUX_FILES = re.compile(
    r"^(config\.json|generation_config\.json|tokenizer.*|special_tokens_map\.json|"
    r"added_tokens\.json|vocab\.(json|txt)|merges\.txt|.*\.tiktoken|chat_template\.(jinja|json)|"
    r".*\.safetensors\.index\.json)$"
)

# sentence-transformers' own files (kiln/kinds/embedding.py reads them): the module list, the
# pooling config in its numbered folder, the trained sequence length.
_ST_FILES = re.compile(r"^(modules\.json|sentence_bert_config\.json|"
                       r"config_sentence_transformers\.json|\d+_Pooling/config\.json)$")


@dataclass
class DownloadPlan:
    format: str  # "gguf" | "safetensors"
    files: list[str]  # repo-relative names
    quant: str | None = None


def plan_download(
    repo_id: str, repo_files: Sequence[str], quant: str | None, default_quant: str | None = None
) -> DownloadPlan:
    """Which files of a repo to fetch: one GGUF (all parts) for :QUANT or GGUF-only repos, else
    the top-level safetensors + config/tokenizer files (never .bin/.pth/onnx duplicates)."""
    groups = group_gguf([f for f in repo_files if f.endswith(".gguf")])
    st = safetensors_names(repo_files)
    has_config = "config.json" in repo_files
    if quant is None and has_config and st:
        aux = [f for f in repo_files
               if ("/" not in f and _AUX_FILES.match(f)) or _ST_FILES.match(f)]
        return DownloadPlan("safetensors", sorted(set(st + aux)))
    if quant is not None or groups:
        parts, q = pick_gguf_group(groups, quant, default_quant, repo_id)
        return DownloadPlan("gguf", parts, q)
    raise ModelNotFoundError(msg("download.no_weights", repo=repo_id),
                             hint=msg("download.no_weights.hint"))


def _hub_error(repo_id: str, e: Exception) -> KilnError:
    """One KilnError a user can act on, whatever the hub client raised: its own HTTP errors by
    status, connection failures from whichever HTTP library it runs on (httpx, or the `httpx2`
    fork newer huggingface_hub versions vendor), disk errors."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(e, GatedRepoError):
        return ModelNotFoundError(msg("download.gated", repo=repo_id),
                                  hint=msg("download.gated.hint", repo=repo_id))
    if isinstance(e, RepositoryNotFoundError):
        return not_found(
            repo_id,
            msg("download.no_repo", repo=repr(repo_id)),
            extra=msg("download.no_repo.hint"),
        )
    disk = _disk_error(e)
    if disk is not None:
        return KilnError(msg("download.disk_full", repo=repo_id, path=hf_cache_dir(),
                             error=_short(disk)),
                         hint=msg("download.disk_full.hint", repo=repo_id))
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, HfHubHTTPError) and isinstance(status, int):
        hint_key = ("download.http.401" if status in (401, 403) else
                    "download.http.429" if status == 429 else
                    "download.http.5xx" if status >= 500 else "download.failed.hint")
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        return KilnError(msg("download.http", repo=repo_id, status=status, reason=reason),
                         hint=msg(hint_key, repo=repo_id))
    if _is_cut(e):
        return KilnError(msg("download.cut", repo=repo_id, error=_short(e)),
                         hint=msg("download.cut.hint", repo=repo_id))
    if _is_connection_error(e):
        from huggingface_hub import constants

        return KilnError(msg("download.unreachable", endpoint=constants.ENDPOINT, repo=repo_id,
                             error=_short(e)), hint=msg("download.unreachable.hint"))
    return KilnError(msg("download.failed", repo=repo_id, error=_short(e)),
                     hint=msg("download.failed.hint", repo=repo_id))


def _disk_error(e: BaseException) -> OSError | None:
    """The OSError (here or in the causes) that says the disk is full: no space, over quota,
    or over the process's file size limit."""
    import errno

    full = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in full:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _is_cut(e: BaseException) -> bool:
    """A download whose connection kept dropping mid-file: the hub client resumes a few times
    (HTTP Range), then gives up with the transport's error or its size check."""
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"RemoteProtocolError", "ReadError", "ChunkedEncodingError"}) or (
        isinstance(e, OSError) and "Consistency check failed" in str(e))


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _is_connection_error(e: BaseException) -> bool:
    """A failure to reach the host (DNS, refused, timeout, proxy), by the exception's family:
    the HTTP library differs between huggingface_hub versions."""
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "ConnectTimeout", "ConnectionError", "ProxyError",
                         "TimeoutException", "NetworkError", "gaierror", "TimeoutError",
                         "OfflineModeIsEnabled"})


def check_hub_reachable(repo_id: str, timeout: float = 5.0) -> None:
    """Fails in about a second when the hub cannot be reached at all (no network, no DNS), with
    what to do, instead of after the hub client's half a minute of retries."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise KilnError(msg("download.unreachable", endpoint=constants.ENDPOINT, repo=repo_id,
                            error=_short(e)), hint=msg("download.unreachable.hint")) from None


def download_model(
    repo_id: str, quant: str | None = None, *, default_quant: str | None = None, spec: str
) -> ModelSource:
    """Fetch repo_id into the HF cache (resumable, with progress bars) and resolve it."""
    import huggingface_hub as hub

    cache = hf_cache_dir()
    check_hub_reachable(repo_id)
    try:
        files = hub.list_repo_files(repo_id)
        plan = plan_download(repo_id, files, quant, default_quant)
        print(
            f"kiln: downloading {repo_id} ({', '.join(plan.files[:4])}"
            f"{', ...' if len(plan.files) > 4 else ''}) into {cache}",
            file=sys.stderr,
        )
        if plan.format == "gguf":
            for name in plan.files:
                hub.hf_hub_download(repo_id, name, cache_dir=cache)
        else:
            # Exact names as fnmatch patterns, so only the planned files come down.
            patterns = [glob_escape(f) for f in plan.files]
            hub.snapshot_download(repo_id, allow_patterns=patterns, cache_dir=cache)
    except KilnError:
        raise
    except Exception as e:  # every hub failure becomes one line with what to do
        raise _hub_error(repo_id, e) from e
    snap = cached_snapshot(repo_id, cache)
    if snap is None:  # the hub writes refs/main on success, so this is a hub/cache bug
        raise KilnError(f"downloaded {repo_id} but it is not in {cache}", hint="re-run the pull")
    return source_from_dir(
        snap,
        spec=spec,
        kind="hf",
        origin="downloaded",
        quant=plan.quant if plan.format == "gguf" else None,
        repo_id=repo_id,
        default_quant=default_quant,
    )


# ---------------------------------------------------------------------------------------------
# Resolution
