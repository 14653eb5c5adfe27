"""Every environment variable the distribution reads, declared once: its type, default and meaning.

Read one as ``envs.SGLANG_CPKV_CHECKED.get()``; a test sets one for a block with
``with envs.SGLANG_CPKV_CHECKED.override(True): ...``. In the style of upstream's ``sglang/srt/environ.py`` (the same
``get``/``is_set``/``set``/``override``), except that a value that does not parse is an error naming the variable
(upstream warns and takes the default). Unset and empty read the same: the default. Booleans are parsed here
only (:func:`parse_bool`). The fields marked ``user_facing`` are the README's settings table
(``test/registered/env/test_settings_registry.py`` holds the two together). Standard library only: the overlay
tool and the P/D launcher import it. Setting raw variables for a block of code (a child's environment):
:func:`environment`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

TRUE_SPELLINGS = ("1", "true", "yes", "on")
FALSE_SPELLINGS = ("0", "false", "no", "off")
# Upstream's own boolean spellings (EnvBool in sglang/srt/environ.py): upstream's reading of its variables decides
# what upstream does, so ours of those must agree with it (test_settings_registry.py checks them against upstream's).
UPSTREAM_TRUE_SPELLINGS = ("true", "1", "yes", "y")
UPSTREAM_FALSE_SPELLINGS = ("false", "0", "no", "n")

# Who reads a variable (Envs.in_scope).
SERVING = "serving"  # a server of the mode, and the ops wherever they run
OVERLAY = "overlay"  # python -m sglang_cpkv.overlay
PD_LAUNCH = "pd_launch"  # python -m sglang_cpkv.pd_launch, scripts/pd/, the image's entry point
TESTING = "testing"  # test support (sglang_cpkv.testing): never part of serving
UPSTREAM = "upstream"  # upstream sglang's variables that we read too
EXTERNAL = "external"  # variables of the platform or of other tools


def parse_bool(
    name: str, text: str, spellings: tuple[tuple[str, ...], tuple[str, ...]] = (TRUE_SPELLINGS, FALSE_SPELLINGS)
) -> bool:
    """``text``, the value of variable ``name``, as a boolean: one of ``spellings`` (true ones, false ones; any case,
    surrounding blanks ignored). Anything else is a :class:`ValueError` naming the variable."""
    true, false = spellings
    value = text.strip().lower()
    if value in true:
        return True
    if value in false:
        return False
    raise ValueError(f"{name}={text!r}: expected one of {', '.join(true + false)}")


class EnvField:
    """One environment variable: its name (the attribute's name in :class:`Envs`), old names (``aliases``), the
    default when unset or empty, and a one-line description (``doc``)."""

    def __init__(
        self, default: Any, doc: str, *, scope: str, aliases: tuple[str, ...] = (), user_facing: bool = False
    ) -> None:
        self.default = default
        self.doc = doc
        self.scope = scope
        self.aliases = aliases
        self.user_facing = user_facing
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, default={self.default!r})"

    @property
    def names(self) -> tuple[str, ...]:
        """The name, then the old names still read."""
        return (self.name, *self.aliases)

    def lookup(self, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
        """``(variable, text)`` as set in ``environ`` (default ``os.environ``): the name, else an old name; None when
        neither is set. The name and an old name set to different values is an error naming both."""
        environ = os.environ if environ is None else environ
        found = [(name, environ[name]) for name in self.names if environ.get(name) is not None]
        if len({text for _, text in found}) > 1:
            raise ValueError(
                " and ".join(f"{name}={text!r}" for name, text in found)
                + f" disagree ({', '.join(self.aliases)}: the old name of {self.name}); set one"
            )
        return found[0] if found else None

    def text(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value as set, unparsed (``""`` when set empty); None when unset."""
        found = self.lookup(environ)
        return None if found is None else found[1]

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether set to a non-empty value (empty reads as unset)."""
        return bool(self.text(environ))

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value, parsed; the default when unset or empty."""
        found = self.lookup(environ)
        if found is None or found[1] == "":
            return self.default
        return self.parse(*found)

    def parse(self, name: str, text: str) -> Any:
        raise NotImplementedError

    def format(self, value: Any) -> str:
        return str(value)

    def set(self, value: Any) -> None:
        """Set it in ``os.environ`` (None: unset it); old names are unset either way."""
        for alias in self.aliases:
            os.environ.pop(alias, None)
        if value is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.format(value)

    def clear(self) -> None:
        self.set(None)

    @contextlib.contextmanager
    def override(self, value: Any) -> Iterator[None]:
        """For the block only: set to ``value`` (None: unset); the name and its old names put back after it."""
        saved = {name: os.environ.get(name) for name in self.names}
        self.set(value)
        try:
            yield
        finally:
            for name, text in saved.items():
                if text is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = text

    def __bool__(self) -> bool:
        raise TypeError(f"read {self.name} with envs.{self.name}.get()")


class EnvStr(EnvField):
    def parse(self, name: str, text: str) -> str:
        return text


class EnvBool(EnvField):
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``, any case; blank reads as the default."""

    spellings = (TRUE_SPELLINGS, FALSE_SPELLINGS)

    def parse(self, name: str, text: str) -> bool | None:
        return self.default if not text.strip() else parse_bool(name, text, self.spellings)

    def format(self, value: Any) -> str:
        return "1" if value else "0"


class EnvInt(EnvField):
    def parse(self, name: str, text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name}={text!r}: expected an integer") from None


class UpstreamBool(EnvBool):
    """A boolean upstream declares and reads; read with upstream's spellings (its ``EnvBool``)."""

    spellings = (UPSTREAM_TRUE_SPELLINGS, UPSTREAM_FALSE_SPELLINGS)

    def format(self, value: Any) -> str:
        return "true" if value else "false"


class Envs:
    """The registry: one field per variable (name, old names, default, description, who reads it)."""

    # ---------------------------------------------------------------- serving: the README's settings table
    SGLANG_CPKV_OPS_BACKEND = EnvStr(
        "auto", "the ops' backend: auto, cuda, triton or torch (ops/__init__.py)", scope=SERVING, user_facing=True
    )
    SGLANG_CPKV_CUDA_LIB = EnvStr(
        None,
        "path of a prebuilt sglang_cpkv_cuda.so or its directory; unset: the package's ops/prebuilt/",
        scope=SERVING,
        user_facing=True,
    )
    SGLANG_CPKV_CUDA_JIT = EnvBool(
        False,
        "JIT-build the CUDA ops when no prebuilt library is found (development; serving never compiles)",
        scope=SERVING,
        user_facing=True,
    )
    SGLANG_CPKV_CUDA_CACHE = EnvStr(
        None,
        "the JIT build's cache root; unset: $XDG_CACHE_HOME/sglang_cpkv/cuda, else ~/.cache/sglang_cpkv/cuda",
        scope=SERVING,
        user_facing=True,
    )
    SGLANG_CPKV_CHECKED = EnvBool(
        False, "checked mode: ops synchronize and per-request invariants are asserted", scope=SERVING, user_facing=True
    )
    SGLANG_CPKV_LAYER_AHEAD = EnvBool(
        None,
        "prefetch each layer's history one layer ahead; unset: on under CP, off at cp 1 (hooks/settings.py)",
        scope=SERVING,
        user_facing=True,
    )
    SGLANG_CPKV_DRAFT_SHARED_KV = EnvBool(
        False,
        "the speculative draft's extends run under the target's CP split (needed for an EAGLE/NextN draft)",
        scope=SERVING,
        aliases=("SGLANG_CP_DRAFT_SHARED_KV",),
        user_facing=True,
    )

    # ---------------------------------------------------------------- upstream's, read by us too
    SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER = UpstreamBool(
        False,
        "every prefill CP rank sends its pages; the mode's prefill server requires it (hooks/server_args.py)",
        scope=UPSTREAM,
        user_facing=True,
    )
    SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND = EnvStr(
        "rust", "upstream's radix tree core; the mode needs python (or unset: it then chooses python)", scope=UPSTREAM
    )

    # ---------------------------------------------------------------- the overlay tool
    SGLANG_CPKV_ROOT = EnvStr(
        None, "the queue root (UPSTREAM.toml and patches/); unset: found from here", scope=OVERLAY
    )
    SGLANG_CPKV_CACHE = EnvStr(
        None, "the upstream wheel download cache; unset: <queue root>/.cache/upstream", scope=OVERLAY
    )
    SGLANG_CPKV_INDEX_URL = EnvStr(
        "https://pypi.org/simple", "the package index (simple API) upstream wheels are checked against", scope=OVERLAY
    )

    # ---------------------------------------------------------------- the P/D launcher (pd_launch/config.py parses)
    PD_MODEL_PATH = EnvStr(
        "zai-org/GLM-5.1-FP8",
        "the model: a local directory or a Hugging Face id (set but empty: an error)",
        scope=PD_LAUNCH,
    )
    PD_PYTHON = EnvStr(None, "the interpreter that runs the roles and their checks; unset: this one", scope=PD_LAUNCH)
    PD_TRUST_REMOTE_CODE = EnvStr("1", "--trust-remote-code on the servers (0/1)", scope=PD_LAUNCH)
    PD_TRANSFER_BACKEND = EnvStr("mooncake", "--disaggregation-transfer-backend", scope=PD_LAUNCH)
    PD_IB_DEVICE = EnvStr("", "--disaggregation-ib-device (empty: none)", scope=PD_LAUNCH)
    PD_BOOTSTRAP_PORT = EnvStr("8998", "--disaggregation-bootstrap-port of the prefill", scope=PD_LAUNCH)
    # flashmla_auto prefill with a flashmla_kv decode keeps both sides on the 656-byte FP8 row layout; leaving
    # one side unset on SM>=10 FP8 pairs it with trtllm (576-byte rows), which the other side cannot read.
    PD_DSA_PREFILL_BACKEND = EnvStr("flashmla_auto", "--dsa-prefill-backend of both servers", scope=PD_LAUNCH)
    PD_DSA_DECODE_BACKEND = EnvStr("flashmla_kv", "--dsa-decode-backend of both servers", scope=PD_LAUNCH)
    # Both servers, so that both sides agree on the KV row layout on every GPU: upstream's own default ("auto") is
    # bf16 for DSA on Hopper (1,284 bytes a token a layer: GLM-5.1-FP8's prefill on 8 x H200 then cannot hold one
    # request of its context at any fraction that leaves room for activations) and FP8 on Blackwell.
    PD_KV_CACHE_DTYPE = EnvStr("fp8_e4m3", "--kv-cache-dtype of both servers", scope=PD_LAUNCH)
    PD_PREFILL_HOST = EnvStr("0.0.0.0", "the prefill's listen address", scope=PD_LAUNCH)
    PD_PREFILL_PORT = EnvStr("30000", "the prefill's port", scope=PD_LAUNCH)
    PD_PREFILL_TP = EnvStr("8", "the prefill's --tp-size", scope=PD_LAUNCH)
    PD_PREFILL_CP = EnvStr("8", "the prefill's --attn-cp-size (prefill CP when > 1)", scope=PD_LAUNCH)
    PD_PREFILL_DP = EnvStr("1", "the prefill's --attn-dp-size", scope=PD_LAUNCH)
    PD_CP_STRATEGY = EnvStr("interleave", "the prefill's --cp-strategy", scope=PD_LAUNCH)
    PD_PREFILL_BASE_GPU_ID = EnvStr("0", "the prefill's --base-gpu-id", scope=PD_LAUNCH)
    PD_CHUNKED_PREFILL_SIZE = EnvStr("65536", "the prefill's --chunked-prefill-size", scope=PD_LAUNCH)
    # --mem-fraction-static: weights + KV pool over the GPU's memory (the rest holds activations). Upstream's own
    # default keeps 1.5 MB per chunk token, which at chunk 65536 leaves GLM-5.1-FP8's prefill on 8 x H200 no KV
    # budget at all (0.258; 0.636 on B300); 0.85 holds one request of the context length on both (the dry-run checks
    # it, the capacity planner's default). "auto": upstream's heuristic (the decode's default: 0.92-0.96 there).
    PD_PREFILL_MEM_FRACTION_STATIC = EnvStr(
        "0.85", "the prefill's --mem-fraction-static in (0, 1], or auto (upstream's)", scope=PD_LAUNCH
    )
    PD_CP_SHARED_KV = EnvStr("0", "--enable-cp-shared-kv on the prefill (0/1)", scope=PD_LAUNCH)
    PD_PREFILL_EXTRA_ARGS = EnvStr("", "more arguments of the prefill server (shell words)", scope=PD_LAUNCH)
    PD_DECODE_HOST = EnvStr("0.0.0.0", "the decode's listen address", scope=PD_LAUNCH)
    PD_DECODE_PORT = EnvStr("30001", "the decode's port", scope=PD_LAUNCH)
    PD_DECODE_TP = EnvStr("8", "the decode's --tp-size", scope=PD_LAUNCH)
    PD_DECODE_DP = EnvStr("8", "the decode's --attn-dp-size", scope=PD_LAUNCH)
    PD_DECODE_BASE_GPU_ID = EnvStr("0", "the decode's --base-gpu-id", scope=PD_LAUNCH)
    PD_DECODE_CUDA_GRAPH_MAX_BS = EnvStr("64", "the decode's --cuda-graph-max-bs", scope=PD_LAUNCH)
    PD_DECODE_MEM_FRACTION_STATIC = EnvStr(
        "auto", "the decode's --mem-fraction-static in (0, 1], or auto (upstream's)", scope=PD_LAUNCH
    )
    PD_DECODE_EXTRA_ARGS = EnvStr("", "more arguments of the decode server (shell words)", scope=PD_LAUNCH)
    PD_ROUTER_HOST = EnvStr("0.0.0.0", "the router's listen address", scope=PD_LAUNCH)
    PD_ROUTER_PORT = EnvStr("8000", "the router's port", scope=PD_LAUNCH)
    # How the router reaches the servers. The router hands the prefill URL's host to every decode as the
    # address of the prefill's bootstrap server, so on two nodes both must be addresses the other nodes reach.
    PD_PREFILL_URL = EnvStr(
        "", "the prefill's URL for the router; empty: http://127.0.0.1:$PD_PREFILL_PORT", scope=PD_LAUNCH
    )
    PD_DECODE_URL = EnvStr(
        "", "the decode's URL for the router; empty: http://127.0.0.1:$PD_DECODE_PORT", scope=PD_LAUNCH
    )
    PD_ROUTER_EXTRA_ARGS = EnvStr("", "more arguments of the router (shell words)", scope=PD_LAUNCH)
    PD_LOG_DIR = EnvStr("", "logs and pid records; empty: $XDG_STATE_HOME/sglang-cpkv/pd-logs", scope=PD_LAUNCH)
    PD_LOG_MAX_BYTES = EnvStr(
        "256M", "a log is rotated (<log>.1, .2, ...) when it would grow past this", scope=PD_LAUNCH
    )
    PD_LOG_KEEP = EnvStr("5", "rotated files kept per log, and launch logs kept per role", scope=PD_LAUNCH)
    PD_HEALTH_TIMEOUT = EnvStr("1800", "seconds a start waits for the role's health", scope=PD_LAUNCH)
    PD_STOP_TIMEOUT = EnvStr("60", "seconds a stop waits before it kills", scope=PD_LAUNCH)
    PD_GPU_CAPABILITY = EnvStr(
        "", "the GPU the dry-run resolves for (MAJOR.MINOR); empty: this machine's", scope=PD_LAUNCH
    )

    # ---------------------------------------------------------------- test support
    SGLANG_CPKV_REQUIRE_UPSTREAM = EnvBool(
        False, "an upstream-backed test that cannot run fails instead of skipping (the GPU test env)", scope=TESTING
    )
    SGLANG_CPKV_GPU_TEST_ENV = EnvStr(
        None, "the GPU test environment's directory (its env file sets it)", scope=TESTING
    )
    SGLANG_CPKV_SGL_KERNEL_STANDIN = EnvStr(
        None,
        "set to 1 while the sgl_kernel import-only stand-in is installed (testing/sgl_kernel_standin.py)",
        scope=TESTING,
    )

    # ---------------------------------------------------------------- the platform's and other tools'
    XDG_CACHE_HOME = EnvStr(None, "the user's cache directory; unset: ~/.cache", scope=EXTERNAL)
    XDG_STATE_HOME = EnvStr(None, "the user's state directory; unset: ~/.local/state", scope=EXTERNAL)
    CUDA_VISIBLE_DEVICES = EnvStr(None, "the GPUs a process sees; --base-gpu-id counts within them", scope=EXTERNAL)
    TRITON_INTERPRET = EnvBool(False, "Triton's interpreter: its kernels run on CPU tensors", scope=EXTERNAL)

    @classmethod
    def fields(cls) -> dict[str, EnvField]:
        """Every declared variable by name (old names not included), in declaration order."""
        return {name: field for name, field in vars(cls).items() if isinstance(field, EnvField)}

    @classmethod
    def field(cls, name: str) -> EnvField:
        """The field of variable ``name`` (its name or an old one)."""
        for field in cls.fields().values():
            if name in field.names:
                return field
        raise KeyError(f"{name} is not declared in sglang_cpkv.envs")

    @classmethod
    def in_scope(cls, scope: str) -> dict[str, EnvField]:
        return {name: field for name, field in cls.fields().items() if field.scope == scope}


envs = Envs()


@contextlib.contextmanager
def environment(values: Mapping[str, str] = {}, keep: tuple[str, ...] = ()) -> Iterator[None]:
    """For the block only: ``values`` set in ``os.environ``; those names and ``keep`` (names the block itself may
    set) are put back as they were after it, an unset one unset."""
    saved = {name: os.environ.get(name) for name in (*values, *keep)}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
