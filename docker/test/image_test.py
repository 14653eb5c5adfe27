#!/usr/bin/env python3
"""Every command docs/operations.md and the compose file document, run in containers of the image (`make image-test`).

Not part of `make test` (minutes, and it needs a Docker engine): run for an image change, its report kept with the
command (benchmark/results/). No GPU is needed: the two servers are stand-ins (sglang_cpkv/testing/pd_stub.py, as
PD_PYTHON, through the real launchers), the router is the real one, and the dry-run resolves upstream's real server
arguments from a config.json in a mounted Hugging Face cache. Each check prints PASS or FAIL with what it saw; the
exit status is 1 when any failed. Traffic stays on loopback (containers on --network host, free ports only).

    docker/test/image_test.py [--image TAG] [--cuda-image TAG] [--build-checks] [--out report.json]
      --image TAG        the image under test (default sglang-cpkv:0.5.23; `make image` builds it)
      --cuda-image TAG   also check an image built with the CUDA ops: the library loads and exports the ops
      --build-checks     also build the image from a fresh clone made under umask 027 whose origin URL carries
                         credentials (BASE_IMAGE: the base to build on), and refuse such a URL given directly
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "operations.md"  # where the image's commands are documented
COMPOSE = REPO / "docker" / "compose.pd.yaml"
DOCUMENTED_TAG = "sglang-cpkv:0.5.23"
STUB = "/opt/sglang-cpkv/python/sglang_cpkv/testing/pd_stub.py"
MODEL = "zai-org/GLM-5.1-FP8"  # the launchers' default PD_MODEL_PATH
MODEL_CONFIG = REPO / "test" / "registered" / "upstream" / "fixtures" / "glm5_dsa" / "config.json"
SECRETS = {
    "HF_TOKEN": "hf_imagetestsecret0123",
    "SGLANG_CPKV_INDEX_URL": "https://ci:pw-imagetest-9876@index.invalid/simple",
}
SECRET_WORDS = ("hf_imagetestsecret0123", "pw-imagetest-9876")
USER = "1000:1000"  # an operator's own uid, as the documented `--user $(id -u):$(id -g)`


def docker_cli() -> list[str]:
    """The client that matches the daemon: Debian's docker.io is /usr/bin/docker."""
    return ["/usr/bin/docker"] if Path("/usr/bin/docker").is_file() else ["docker"]


def compose_cli() -> list[str]:
    if subprocess.run([*docker_cli(), "compose", "version"], capture_output=True).returncode == 0:
        return [*docker_cli(), "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise SystemExit("neither `docker compose` nor docker-compose is installed")


def run(cmd: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def documented_line(startswith: str) -> str:
    """A documented command from docs/operations.md, continuation lines joined (what an operator copies)."""
    lines = DOCS.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith(startswith):
            text = line
            while text.endswith("\\"):
                i += 1
                text = text[:-1].rstrip() + " " + lines[i].strip()
            return text
    raise AssertionError(f"{DOCS.relative_to(REPO)} has no line starting {startswith!r}")


class ImageTest:
    def __init__(self, image: str, work: Path) -> None:
        self.image, self.work = image, work
        self.results: list[dict] = []
        self.docker = docker_cli()
        self.containers: list[str] = []
        self.home = work / "home"  # the operator's $HOME
        self.hf = self.home / ".cache" / "huggingface"
        self.logs = self.home / ".local" / "state" / "sglang-cpkv" / "pd-logs"
        self.stub = work / "stub_python"
        self.ports = {name: free_port() for name in ("prefill", "decode", "router", "bootstrap")}

    # ------------------------------------------------------------------ bookkeeping
    def check(self, name: str, ok: bool, seen: str) -> bool:
        self.results.append({"check": name, "passed": bool(ok), "seen": seen[-2000:]})
        print(f"{'PASS' if ok else 'FAIL'} {name}" + ("" if ok else f"\n  {seen[-1500:]}"), flush=True)
        return ok

    def docker_run(self, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        return run([*self.docker, "run", *args], timeout=timeout)

    def cleanup(self) -> None:
        for name in self.containers:
            run([*self.docker, "rm", "-f", name], timeout=120)
        self.containers = []

    def prepare_host(self) -> None:
        snapshot = self.hf / "hub" / f"models--{MODEL.replace('/', '--')}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        shutil.copy(MODEL_CONFIG, snapshot / "config.json")
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
        self.logs.mkdir(parents=True)  # the docs: mkdir -p, then --user $(id -u):$(id -g)
        uid, gid = (int(x) for x in USER.split(":"))
        for path in (self.home, self.logs, *self.logs.parents):
            if str(path).startswith(str(self.home)):
                os.chown(path, uid, gid)
        self.stub.write_text(f'#!/bin/sh\nexec python3 {STUB} "$@"\n')
        self.stub.chmod(0o755)
        self.work.chmod(0o755)

    def role_env(self) -> list[str]:
        p = self.ports
        env = {
            "PD_PREFILL_PORT": p["prefill"],
            "PD_DECODE_PORT": p["decode"],
            "PD_ROUTER_PORT": p["router"],
            "PD_BOOTSTRAP_PORT": p["bootstrap"],
            "PD_PREFILL_URL": f"http://127.0.0.1:{p['prefill']}",
            "PD_DECODE_URL": f"http://127.0.0.1:{p['decode']}",
            "PD_STOP_TIMEOUT": 20,
            **SECRETS,
        }
        return [a for k, v in env.items() for a in ("-e", f"{k}={v}")]

    def common(self, *, user: str = USER) -> list[str]:
        """The documented `common` flags, less the GPUs and the RDMA device this machine lacks, and `--ulimit memlock=-1`
        (an unprivileged engine may not raise it)."""
        return [
            "--init", "--network", "host", "--ipc", "host", "--shm-size", "1g",
            "--user", user, "-v", f"{self.hf}:/home/sglang/.cache/huggingface", "-v", f"{self.logs}:/var/log/sglang-cpkv",
            "--stop-timeout", "30", *self.role_env(),
        ]  # fmt: skip

    def start_role(self, role: str, extra: list[str] = (), name: str | None = None) -> str:
        name = name or f"cpkv-imagetest-{role}-{os.getpid()}"
        stub = (
            []
            if role == "router"
            else [
                "-v",
                f"{self.stub}:/stub/python:ro",
                "-e",
                "PD_PYTHON=/stub/python",
                "-e",
                "PD_LAUNCH_PYTHON=python3",
            ]
        )
        out = self.docker_run(["-d", "--name", name, *self.common(), *stub, *extra, self.image, role])
        if out.returncode:
            raise AssertionError(f"docker run {role}: {out.stderr}")
        self.containers.append(name)
        return name

    def wait_status(self, container: str, role: str, timeout: float = 120) -> subprocess.CompletedProcess:
        deadline = time.monotonic() + timeout
        while True:
            out = run([*self.docker, "exec", container, "/opt/sglang-cpkv/docker/entrypoint.sh", "status", role])
            if out.returncode == 0 or time.monotonic() > deadline:
                return out
            time.sleep(2)

    # ------------------------------------------------------------------ the checks
    def help(self) -> None:
        out = self.docker_run(["--rm", self.image])
        self.check(
            "help (the image's default command)",
            out.returncode == 0 and "prefill | decode | router" in out.stdout,
            out.stdout + out.stderr,
        )

    def dry_run(self) -> None:
        line = documented_line("docker run --rm -v $HOME/.cache/huggingface")
        argv = line.replace("$HOME", str(self.home)).replace(DOCUMENTED_TAG, self.image).split()
        out = run([*self.docker, *argv[1:]], timeout=600)
        text = out.stdout + out.stderr
        self.check(
            "dry-run, the documented line, config.json in the mounted Hugging Face cache",
            out.returncode == 0
            and all(f"# {r}: flags accepted" in text for r in ("prefill", "decode", "router"))
            and text.count("start-up checks passed") == 2,
            text,
        )

    def roles(self) -> None:
        prefill, decode = self.start_role("prefill"), self.start_role("decode")
        ok = [self.wait_status(c, r) for c, r in ((prefill, "prefill"), (decode, "decode"))]
        self.check(
            "prefill and decode (stand-in servers) healthy: entrypoint status",
            all(o.returncode == 0 for o in ok),
            "\n".join(o.stdout + o.stderr for o in ok),
        )
        router = self.start_role("router")
        out = self.wait_status(router, "router")
        self.check(
            "router (the real sglang-router) healthy with both workers: entrypoint status",
            out.returncode == 0,
            out.stdout + out.stderr,
        )
        health = run([*self.docker, "exec", router, "/opt/sglang-cpkv/docker/entrypoint.sh", "health"])
        self.check(
            "health (the image's HEALTHCHECK command) of the router container",
            health.returncode == 0,
            health.stdout + health.stderr,
        )
        self.validate()
        self.secrets_absent([prefill, decode, router])
        self.lifecycle(prefill)
        self.cleanup()  # compose's roles take the same ports

    def validate(self) -> None:
        line = documented_line("docker run --rm --network host --user")
        argv = (
            line.replace("$HOME", str(self.home))
            .replace('"$(id -u):$(id -g)"', USER)
            .replace("$(id -u):$(id -g)", USER)
            .replace(DOCUMENTED_TAG, self.image)
            .replace("http://127.0.0.1:8000", f"http://127.0.0.1:{self.ports['router']}")
            .split()
        )
        out = run([*self.docker, *argv[1:]], timeout=600)
        report = self.logs / "contamination.json"
        self.check(
            "validate, the documented line, against the router (exit 0, report in the operator's log directory)",
            out.returncode == 0 and report.is_file(),
            out.stdout + out.stderr,
        )

    def secrets_absent(self, containers: list[str]) -> None:
        seen = []
        for c in containers:
            logs = run([*self.docker, "logs", c])
            seen.append(logs.stdout + logs.stderr)
            seen.append(
                run([*self.docker, "inspect", c])
                .stdout.replace(SECRETS["HF_TOKEN"], "")
                .replace(SECRETS["SGLANG_CPKV_INDEX_URL"], "")
            )
        seen += [p.read_text(errors="replace") for p in self.logs.rglob("*") if p.is_file()]
        leaked = [w for w in SECRET_WORDS if any(w in text for text in seen)]
        self.check(
            "no secret in docker logs, the launch logs or docker inspect (beyond the env given)",
            not leaked,
            f"leaked: {leaked}",
        )
        image = (
            run([*self.docker, "inspect", self.image]).stdout
            + run([*self.docker, "history", "--no-trunc", self.image]).stdout
        )
        self.check(
            "no credential in the image's labels or history",
            "@"
            not in json.dumps(
                json.loads(run([*self.docker, "inspect", "-f", "{{json .Config.Labels}}", self.image]).stdout)
            )
            and "pw-" not in image,
            image[-500:],
        )

    def lifecycle(self, container: str) -> None:
        stopped = run([*self.docker, "stop", "-t", "30", container], timeout=120)
        state = run([*self.docker, "inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", container]).stdout.strip()
        self.check(
            "docker stop ends the role (SIGTERM, within PD_STOP_TIMEOUT)",
            stopped.returncode == 0 and state.startswith("exited"),
            state + stopped.stderr,
        )
        run([*self.docker, "start", container])
        out = self.wait_status(container, "prefill")
        self.check("docker start after stop: healthy again", out.returncode == 0, out.stdout + out.stderr)
        run([*self.docker, "restart", "-t", "30", container], timeout=120)
        out = self.wait_status(container, "prefill")
        self.check("docker restart: healthy again", out.returncode == 0, out.stdout + out.stderr)
        run([*self.docker, "kill", container])
        run([*self.docker, "start", container])
        out = self.wait_status(container, "prefill")
        self.check(
            "docker kill (SIGKILL), then start: healthy again (stale records cleared)",
            out.returncode == 0,
            out.stdout + out.stderr,
        )

    def default_user(self) -> None:
        """Without --user (uid 10001) on the operator's 0755 directory: refused at once, naming what is not writable."""
        out = self.docker_run(
            ["--rm", "--network", "host", "-v", f"{self.logs}:/var/log/sglang-cpkv", self.image, "prefill"], timeout=120
        )
        self.check(
            "uid 10001 with an unwritable log directory: refused at start, naming it",
            out.returncode == 78 and "/var/log/sglang-cpkv" in out.stderr,
            out.stdout + out.stderr,
        )

    def read_only(self) -> None:
        bare = self.docker_run(["--rm", "--read-only", self.image, "prefill"], timeout=120)
        self.check(
            "--read-only alone: refused at start, naming every directory to mount",
            bare.returncode == 78 and "--tmpfs /tmp" in bare.stderr,
            bare.stdout + bare.stderr,
        )
        line = documented_line("docker run -d --name cpkv-prefill-ro")
        flags = line.split(DOCUMENTED_TAG)[0].split()
        ro = flags[flags.index("--read-only") :]  # the documented line: the role's common flags, then these
        name = self.start_role("prefill", extra=ro, name=f"cpkv-imagetest-ro-{os.getpid()}")
        out = self.wait_status(name, "prefill")
        self.check(
            f"--read-only with the documented mounts ({' '.join(ro)}): healthy",
            out.returncode == 0,
            out.stdout + out.stderr,
        )
        run([*self.docker, "rm", "-f", name], timeout=120)

    def compose(self) -> None:
        """compose up/down from the compose file, on fresh host directories (Docker creates them, root's)."""
        import yaml

        spec = yaml.safe_load(COMPOSE.read_text())
        for service in spec["services"].values():
            service.pop("deploy", None)  # no GPU here, and an unprivileged engine may not raise memlock;
            service.get("ulimits", {}).pop("memlock", None)  # nothing else of the file changes
        for role in ("prefill", "decode"):
            spec["services"][role]["environment"].update(PD_PYTHON="/stub/python", PD_LAUNCH_PYTHON="python3")
            spec["services"][role]["volumes"] = [*spec["services"][role]["volumes"], f"{self.stub}:/stub/python:ro"]
        test_file = self.work / "compose.test.yaml"
        test_file.write_text(yaml.safe_dump(spec))
        fresh = self.work / "fresh"
        p = self.ports
        env = {
            **os.environ, "CPKV_IMAGE": self.image, "HF_CACHE_DIR": str(fresh / "hf"),
            "PD_LOG_DIR_ON_HOST": str(fresh / "pd-logs"), "PD_PREFILL_PORT": str(p["prefill"]),
            "PD_DECODE_PORT": str(p["decode"]), "PD_ROUTER_PORT": str(p["router"]), "PD_BOOTSTRAP_PORT": str(p["bootstrap"]),
            "PD_PREFILL_URL": f"http://127.0.0.1:{p['prefill']}", "PD_DECODE_URL": f"http://127.0.0.1:{p['decode']}",
            "PD_STOP_TIMEOUT": "20", "COMPOSE_PROJECT_NAME": f"cpkvimagetest{os.getpid()}",
        }  # fmt: skip
        compose = [*compose_cli(), "-f", str(test_file)]
        up = run([*compose, "up", "-d"], timeout=900, env=env)
        ok = up.returncode == 0
        seen = up.stdout + up.stderr
        if ok:
            validate = run([*compose, "--profile", "validate", "run", "--rm", "validate"], timeout=600, env=env)
            ok = validate.returncode == 0 and (fresh / "pd-logs" / "contamination.json").is_file()
            seen += validate.stdout + validate.stderr
        if not ok:  # what the services said, before they are removed
            seen += run([*compose, "ps"], env=env).stdout + run([*compose, "logs", "--tail", "40"], env=env).stdout
        down = run([*compose, "down"], timeout=300, env=env)
        self.check(
            "compose up (fresh host directories), validate, down", ok and down.returncode == 0, seen + down.stderr
        )

    def cuda_library(self, image: str) -> None:
        code = (
            "import subprocess, sys\n"
            "from sglang_cpkv.ops import cuda_build\n"
            "lib = cuda_build.prebuilt_library()\n"
            "assert lib is not None and lib.is_file(), 'no prebuilt library'\n"
            "reason = cuda_build.stale_reason(lib)\n"
            "assert not reason, reason\n"
            "syms = subprocess.run(['nm', '-D', '--defined-only', str(lib)], capture_output=True, text=True, check=True).stdout\n"
            "print(lib, len(syms.splitlines()), 'symbols')\n"
            "import torch; torch.ops.load_library(str(lib)); print('loaded')\n"
        )
        out = self.docker_run(["--rm", "--entrypoint", "python3", image, "-c", code], timeout=300)
        self.check(
            f"{image}: the AOT-built CUDA library matches its sources, exports its symbols and loads",
            out.returncode == 0 and "loaded" in out.stdout,
            out.stdout + out.stderr,
        )

    def build_checks(self) -> None:
        """A clone under umask 027 whose origin carries credentials, built with the documented command."""
        clone = self.work / "clone"
        old = os.umask(0o027)
        try:
            run(["git", "clone", "-q", str(REPO), str(clone)], timeout=300, check=True)
        finally:
            os.umask(old)
        for path in (clone / "docker" / "entrypoint.sh", clone / "docker" / "install.sh"):
            # the working tree's uncommitted state is what is under test
            shutil.copy(REPO / path.relative_to(clone), path)
        run(
            [
                "git",
                "-C",
                str(clone),
                "remote",
                "set-url",
                "origin",
                "https://ci-bot:tok-imagetest-4321@git.invalid/org/repo.git",
            ],
            check=True,
        )
        tag = f"sglang-cpkv:imagetest-umask{os.getpid()}"
        env = {**os.environ}
        built = run([str(clone / "docker" / "build.sh"), "--tag", tag, "--no-kernels"], timeout=1800, env=env)
        ok = self.check(
            "make image from a clone made under umask 027 (--no-kernels)",
            built.returncode == 0,
            built.stdout[-1500:] + built.stderr[-1500:],
        )
        if ok:
            out = self.docker_run(["--rm", tag, "help"])
            self.check("its entry point runs (modes made readable)", out.returncode == 0, out.stdout + out.stderr)
            labels = run([*self.docker, "inspect", "-f", "{{json .Config.Labels}}", tag]).stdout
            history = run([*self.docker, "history", "--no-trunc", tag]).stdout
            self.check(
                "the clone URL's credentials are in no label and nowhere in the history",
                "git.invalid/org/repo.git" in labels
                and "tok-imagetest" not in labels + history
                and "ci-bot" not in labels + history,
                labels,
            )
            base = json.loads(labels).get("org.opencontainers.image.base.name", "")
            self.check(
                "the base image's label names the base",
                bool(base) and base == os.environ.get("BASE_IMAGE", base),
                labels,
            )
            run([*self.docker, "rmi", "-f", tag], timeout=300)
        direct = run(
            [*self.docker, "build", "--network", "none", "-f", str(clone / "docker" / "Dockerfile"), "--build-arg", "CPKV_KERNELS=0",
             "--build-arg", "CPKV_SOURCE=https://u:tok-imagetest-4321@git.invalid/x.git",
             *(["--build-arg", f"BASE_IMAGE={os.environ['BASE_IMAGE']}"] if os.environ.get("BASE_IMAGE") else []), str(clone)],
            timeout=1800,
        )  # fmt: skip
        self.check(
            "docker build given a CPKV_SOURCE with credentials: refused",
            direct.returncode != 0 and "refused" in direct.stdout + direct.stderr,
            direct.stdout[-800:] + direct.stderr[-800:],
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", default=DOCUMENTED_TAG)
    parser.add_argument("--cuda-image")
    parser.add_argument("--build-checks", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if run([*docker_cli(), "image", "inspect", args.image]).returncode:
        parser.error(f"--image {args.image}: no such image (make image)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cpkv-image-test-") as tmp:
        test = ImageTest(args.image, Path(tmp))
        try:
            test.prepare_host()
            test.help()
            test.dry_run()
            test.default_user()
            test.read_only()
            test.roles()
            test.compose()
            if args.cuda_image:
                test.cuda_library(args.cuda_image)
            if args.build_checks:
                test.build_checks()
        except Exception as exc:  # a broken step is a failed check, reported with the others
            test.check(f"the test itself ran to the end ({type(exc).__name__})", False, str(exc))
        finally:
            test.cleanup()
    failed = [r["check"] for r in test.results if not r["passed"]]
    summary = {
        "image": args.image,
        "seconds": round(time.monotonic() - started),
        "checks": len(test.results),
        "failed": failed,
        "results": test.results,
    }
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    print(
        f"{len(test.results) - len(failed)} of {len(test.results)} checks passed in {summary['seconds']} s"
        + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
