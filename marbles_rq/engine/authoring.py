"""Defining workflows and steps: decorators, the registry, and loading a --source.

    @step(retries=3)
    def fetch(url: str) -> str: ...

    @workflow()
    def etl(ctx: Context, inp: EtlInput) -> dict: ...

A decorated step called inside a running workflow goes through the ledger (recorded once,
replayed after a redelivery); called anywhere else it is a plain function call.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from .. import metrics
from ..errors import MarblesError

SOURCE_ENV = "MARBLES_SOURCE"
# RQ splits --queues on commas and names keys after the queue; keep names to a set that
# every worker command line and every key can carry as is.
QUEUE_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


class DefinitionError(MarblesError):
    """A workflow or step definition is invalid (duplicate name, bad signature, bad source)."""

    code = "definition"


class UnknownWorkflowError(MarblesError):
    code = "unknown_workflow"


class InputError(MarblesError):
    """A run's input is not JSON, or does not match the workflow's declared input type."""

    code = "invalid_input"


def queue_problem(name: str) -> str | None:
    """Why `name` cannot be a queue name, or None when it can."""
    if QUEUE_PATTERN.fullmatch(name):
        return None
    return f"invalid queue name {name!r}: use 1 to 64 of A-Z a-z 0-9 _ -"


def _where(fn: Callable[..., Any]) -> str:
    code = getattr(fn, "__code__", None)
    if code is None:
        return getattr(fn, "__qualname__", repr(fn))
    return f"{os.path.relpath(code.co_filename)}:{code.co_firstlineno}"


def _return_type(fn: Callable[..., Any]) -> Any:
    try:
        return typing.get_type_hints(fn).get("return", Any)
    except Exception:  # unresolvable annotations: decode results as plain JSON
        return Any


@dataclass
class StepDef:
    name: str
    fn: Callable[..., Any]
    retries: int = 0
    backoff: str = "exponential"  # or "fixed"
    delay_s: float = 1.0
    max_delay_s: float = 60.0
    jitter: bool = True
    result_type: Any = Any
    # A policy given with `retry=` (engine/retry_policy.py); None: the workflow's, else the
    # shorthand above. `on_exhausted`: "fail" | "pause"; None: the workflow's, else "fail".
    retry: Any = None
    on_exhausted: str | None = None
    _shorthand: Any = field(default=None, repr=False, compare=False)
    # The undo each success registers (`compensate=`): a step or a module-level function
    # (engine/compensation.py); None for none.
    compensate: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _route(self, args, kwargs)

    def policy(self, workflow: WorkflowDef | None = None) -> Any:
        """Its Retry: its own `retry=`, else its shorthand when given (`retries=` above 0),
        else the workflow's `retry=`, else no retry."""
        if self.retry is not None:
            return self.retry
        if self.retries or workflow is None or workflow.retry is None:
            if self._shorthand is None:  # built once: it is read at every step's start
                from .retry_policy import shorthand

                self._shorthand = shorthand(self.retries, self.backoff, self.delay_s,
                                            self.max_delay_s, self.jitter)
            return self._shorthand
        return workflow.retry

    def exhausted(self, workflow: WorkflowDef | None = None) -> str:
        """What its last failed try does: "fail" (the run's failure) or "pause"."""
        return self.on_exhausted or (workflow.on_exhausted if workflow is not None else
                                     None) or "fail"


StepRoute = Callable[[StepDef, tuple[Any, ...], dict[str, Any]], Any]


def _call_plainly(step: StepDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return step.fn(*args, **kwargs)


# How a decorated step is called: plainly, until the run context (engine/context.py)
# installs its route, which takes a call made inside a run through the run's ledger. The
# run context installs itself rather than being imported here: it sits above the
# definitions it runs (it needs the registry's types).
_route: StepRoute = _call_plainly


def route_steps(route: StepRoute) -> None:
    """Send every call of a decorated step through `route` (the run context's, once)."""
    global _route
    _route = route


@dataclass
class WorkflowDef:
    name: str
    fn: Callable[..., Any]
    input_param: str | None  # None: the workflow takes no input
    queue: str = "default"
    timeout_s: float = 0.0
    max_deliveries: int = 20
    retention_s: float = 7 * 86400.0
    _input_type: Any = field(default=None, repr=False)
    # Flow control (flow/limits.py): at most `concurrency` runs at once (0: no limit),
    # per value of the input field `concurrency_key` when given; `priority` is the runs'
    # default priority (higher before lower within a queue).
    concurrency: int = 0
    concurrency_key: str | None = None
    priority: int = 0
    # Rate limit (flow/rate_limits.py): a rate string or mr.Rate, taken before the body
    # runs; per value of `rate_key` (an input field, or a function of the input) when given.
    rate_limit: Any = None
    rate_key: Any = None
    # The input parameter's Python default (`def body(ctx, n: int = 5)`) as JSON: what an
    # omitted input means; None when the parameter has none.
    input_default: bytes | None = field(default=None, repr=False)
    # Search tags every run of it carries (engine/tags.py).
    tags: dict[str, str] = field(default_factory=dict)
    # The version its author gave (`version=`); None: a fingerprint of its code
    # (engine/fingerprint.py), computed at first use and kept.
    _version: str | None = field(default=None, repr=False)
    # `current=True`: the version new runs start on, whichever of the name's versions is
    # declared last.
    current: bool = False
    _fingerprint: str | None = field(default=None, repr=False)
    # The default Retry and on_exhausted of its steps (engine/retry_policy.py).
    retry: Any = None
    on_exhausted: str | None = None
    # Debounce, throttle or singleton (flow/gate_specs.py): what an enqueue does first.
    gate: Any = field(default=None, repr=False)

    @property
    def version(self) -> str:
        """The version its runs record: the one given with `version=`, or a fingerprint of
        the body's and its steps' source (10 hex digits)."""
        if self._version is not None:
            return self._version
        if self._fingerprint is None:
            from .fingerprint import fingerprint

            self._fingerprint = fingerprint(self.fn, StepDef)
        return self._fingerprint

    @property
    def is_async(self) -> bool:
        """An `async def` body: executed on an event loop (engine/async_run.py)."""
        return inspect.iscoroutinefunction(self.fn)

    def omitted_input(self, how: str = "give an input") -> bytes:
        """The input JSON a run asked for without one stands for (enqueue without --input, a
        schedule without input=): the parameter's Python default when it has one, else
        `null` for a workflow that takes none (or takes anything), `{}` for an object input
        whose fields all have defaults. An object input with a required field raises
        InputError naming the fields (and `how` to give one)."""
        from .input_check import omitted_input

        if self.input_type is None:
            return b"null"
        if self.input_default is not None:
            return self.input_default
        raw, required = omitted_input(self.input_type)
        if required:
            raise InputError(f"workflow {self.name!r} needs an input: "
                             f"{', '.join(required)} {'has' if len(required) == 1 else 'have'} "
                             f"no default ({how})")
        return raw

    @property
    def input_type(self) -> Any:
        """The declared input type, resolved at first use (so it may be defined later in
        the module); None when the workflow takes no input, Any when unannotated."""
        if self.input_param is None:
            return None
        if self._input_type is None:
            try:
                self._input_type = typing.get_type_hints(self.fn).get(self.input_param, Any)
            except Exception as exc:
                raise DefinitionError(f"workflow {self.name!r} ({_where(self.fn)}): cannot "
                                      f"resolve its input annotation: {exc}") from None
        return self._input_type

    def parse_input(self, raw: bytes, *, strict: bool = False) -> tuple[Any, bytes]:
        """Validate `raw` JSON; returns (the value the body gets, the JSON to record).
        `strict`: a field the input type does not declare is refused, naming it."""
        try:
            if self.input_type is None:
                value = msgspec.json.decode(raw)
                if value not in (None, {}):
                    raise InputError(f"workflow {self.name!r} takes no input")
                return None, b"null"
            value = msgspec.json.decode(raw, type=self.input_type)
            if strict and self.input_type is not Any:
                from .input_check import declared_fields, unknown_field

                unknown = unknown_field(msgspec.json.decode(raw), self.input_type)
                if unknown is not None:
                    fields = declared_fields(self.input_type)
                    raise InputError(f"input of workflow {self.name!r} has an unknown field "
                                     f"{unknown!r}" + (f" (it takes: {', '.join(fields)})"
                                                       if fields else ""))
        except msgspec.ValidationError as exc:
            raise InputError(f"input does not match workflow {self.name!r}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise InputError(f"input is not valid JSON: {exc}") from None
        if self.input_type is Any:
            return value, raw  # recorded verbatim
        return value, msgspec.json.encode(value)  # defaults applied, recorded as used

    def decode_input(self, raw: bytes) -> Any:
        if self.input_type is None:
            return None
        return msgspec.json.decode(raw, type=self.input_type)


@dataclass
class Registry:
    """The loaded definitions. `workflows` maps each name to its current version (the one new
    runs start on: the one marked `current=True`, else the one declared last); `declared`
    holds every version of each name, in the order declared."""

    workflows: dict[str, WorkflowDef] = field(default_factory=dict)
    steps: dict[str, StepDef] = field(default_factory=dict)
    declared: dict[str, list[WorkflowDef]] = field(default_factory=dict)

    @property
    def versions(self) -> dict[str, dict[str, WorkflowDef]]:
        """Workflow name -> version -> its definition."""
        out = {name: {d.version: d for d in defs} for name, defs in self.declared.items()}
        for name, d in self.workflows.items():
            out.setdefault(name, {d.version: d})
        return out

    def serving(self, name: str, version: str) -> WorkflowDef | None:
        """The definition that executes a run of `name` recorded with `version`, or None
        when this registry does not serve it. A run recorded before runs carried a version
        ("") is served by the current definition."""
        current = self.workflows.get(name)
        if current is None or not version or current.version == version:
            return current
        return next((d for d in self.declared.get(name, ()) if d.version == version), None)

    def add_workflow(self, definition: WorkflowDef) -> None:
        """Register one version of a workflow. Several versions of a name need a version each
        (at most one may go without: its fingerprint); the same one at two places is a
        DefinitionError, at the same place again a module loaded twice."""
        name = definition.name
        defs = list(self.declared.get(name, ()))
        for i, other in enumerate(defs):
            if other._version != definition._version:
                continue
            if _where(other.fn) != _where(definition.fn):
                if definition._version is None:
                    raise DefinitionError(
                        f"duplicate workflow name {name!r}: defined at {_where(other.fn)} and "
                        f"{_where(definition.fn)} (to serve several versions of it, give "
                        f"each a version=)")
                raise DefinitionError(
                    f"duplicate workflow {name!r} version {definition._version!r}: defined at "
                    f"{_where(other.fn)} and {_where(definition.fn)}")
            defs[i] = definition  # same place again: a module loaded twice
            break
        else:
            defs.append(definition)
        flagged = [d for d in defs if d.current]
        if len(flagged) > 1:
            raise DefinitionError(
                f"workflow {name!r}: more than one version says current=True (at "
                f"{', '.join(_where(d.fn) for d in flagged)})")
        self.declared[name] = defs
        self.workflows[name] = flagged[0] if flagged else defs[-1]

    def check_versions(self) -> None:
        """Compute every fingerprint now (right after the source is imported, before its
        files can change on disk) and refuse two definitions of a name with one version
        (a fingerprint equal to another's given version)."""
        for name, defs in self.declared.items():
            seen: dict[str, WorkflowDef] = {}
            for d in defs:
                other = seen.setdefault(d.version, d)
                if other is not d:
                    raise DefinitionError(
                        f"duplicate workflow {name!r} version {d.version!r}: defined at "
                        f"{_where(other.fn)} and {_where(d.fn)}")

    def _add(self, table: dict[str, Any], kind: str, name: str, definition: Any) -> None:
        existing = table.get(name)
        if existing is not None and _where(existing.fn) != _where(definition.fn):
            raise DefinitionError(f"duplicate {kind} name {name!r}: defined at "
                                  f"{_where(existing.fn)} and {_where(definition.fn)}")
        table[name] = definition  # same place again: a module loaded twice

    def workflow(self, name: str) -> WorkflowDef:
        try:
            return self.workflows[name]
        except KeyError:
            known = ", ".join(sorted(self.workflows)) or "none loaded; is --source set?"
            raise UnknownWorkflowError(f"unknown workflow {name!r} (known: {known})") from None


REGISTRY = Registry()
metrics.know_workflows(lambda: REGISTRY.workflows)


def step(name: str | Callable[..., Any] | None = None, *, retries: int = 0,
         backoff: str = "exponential", delay_s: float = 1.0, max_delay_s: float = 60.0,
         jitter: bool = True, retry: Any = None, on_exhausted: str | None = None,
         compensate: Any = None) -> Any:
    """Register a step. Usable as ``@step``, ``@step()`` or ``@step("name", retries=3)``.
    `retry=mr.Retry(...)`: its retry policy (`retries=`, `backoff=`, `delay_s=`,
    `max_delay_s=`, `jitter=` are a shorthand for one; not both). `on_exhausted`: "fail"
    (default) or "pause" (the run waits for `marbles-rq retry` or `fail`). `compensate`: a
    step or module-level function registered as the undo of each success (it receives the
    step's arguments, and its result as `result=` if it takes one)."""
    if compensate is not None:
        from .undo_refs import CompensationError, undo_ref

        try:
            undo_ref(compensate, REGISTRY.steps)
        except CompensationError as exc:
            raise DefinitionError(f"compensate=: {exc}") from None
    if backoff not in ("exponential", "fixed"):
        raise DefinitionError(f"backoff must be 'exponential' or 'fixed', not {backoff!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise DefinitionError(f"retries must be a whole number >= 0, not {retries!r}")
    _check_policy(retry, on_exhausted, "step")
    if retry is not None and (retries, backoff, delay_s, max_delay_s, jitter) != (
            0, "exponential", 1.0, 60.0, True):
        raise DefinitionError("a step takes retry=mr.Retry(...) or the shorthand (retries=, "
                              "backoff=, delay_s=, max_delay_s=, jitter=), not both")

    def register(fn: Callable[..., Any]) -> StepDef:
        step_name = name if isinstance(name, str) else fn.__name__
        if not step_name or "|" in step_name or "#" in step_name:
            raise DefinitionError(f"invalid step name {step_name!r}: it must be non-empty, "
                                  f"without '|' or '#' (they mark ledger positions)")
        definition = StepDef(step_name, fn, retries, backoff, delay_s, max_delay_s, jitter,
                             _return_type(fn), retry, on_exhausted, compensate=compensate)
        REGISTRY._add(REGISTRY.steps, "step", step_name, definition)
        return definition

    if callable(name):
        return register(name)
    return register


def workflow(name: str | Callable[..., Any] | None = None, *, queue: str = "default",
             timeout_s: float = 0.0, max_deliveries: int = 20,
             retention_s: float = 7 * 86400.0, concurrency: int | None = None,
             concurrency_key: str | None = None, priority: int = 0,
             tags: dict[str, Any] | None = None, version: str | None = None,
             current: bool = False, retry: Any = None, on_exhausted: str | None = None,
             debounce: str | float | None = None,
             debounce_key: Any = None, debounce_max: str | float | None = None,
             debounce_reduce: Callable[[Any, Any], Any] | None = None,
             throttle: str | None = None, throttle_key: Any = None,
             singleton: str | None = None, singleton_key: Any = None,
             rate_limit: Any = None, rate_key: Any = None) -> Any:
    """Register a workflow: ``def body(ctx)`` or ``def body(ctx, inp: InputType)``.
    A finished run is kept `retention_s` seconds (default 7 days), then pruned.
    `concurrency=N`: at most N runs execute at once across the fleet; with
    `concurrency_key="field"`, at most N per value of that input field. `priority`: the
    runs' default priority (see flow/limits.py). `tags`: search tags every run carries
    (engine/tags.py), filterable in `runs --tag key=value`. `version`: the version its runs
    record (1 to 64 of A-Z a-z 0-9 . _ -); default: a fingerprint of the body's and its
    steps' source, which any edit of them changes. Several versions of one name may be
    declared (each with its `version=`): a worker serves each, new runs start on the one
    declared last, or on the one marked `current=True`. `retry=mr.Retry(...)` and
    `on_exhausted=` ("fail" | "pause"): the defaults of its steps (a step's own win).
    `debounce`, `throttle`, `singleton` (with their `*_key`): what an enqueue does first
    (flow/enqueue_gates.py). `rate_limit="100/min"` (or ``mr.Rate("100/min",
    burst=10)``): runs start their body at most at that rate, held (parked) in order of
    arrival; per value of `rate_key` (an input field, or a function of the input returning
    a string) when given (flow/rate_limits.py)."""
    from ..flow.limit_specs import definition_problem
    from .fingerprint import version_problem
    from .tags import TagError, check_tags

    problem = queue_problem(queue) or definition_problem(concurrency, concurrency_key,
                                                         priority) or (
        None if version is None else version_problem(version))
    if problem is None:
        from ..flow.rate_specs import definition_problem as rate_problem

        problem = rate_problem(rate_limit, rate_key)
    if problem is None and not isinstance(current, bool):
        problem = f"current= must be True or False, not {current!r}"
    if problem is not None:
        raise DefinitionError(problem)
    _check_policy(retry, on_exhausted, "workflow")
    if not 0 <= retention_s <= 10 * 365 * 86400:
        raise DefinitionError(f"retention_s must be between 0 and 10 years, not {retention_s}")
    try:
        declared_tags = check_tags(tags)
    except TagError as exc:
        raise DefinitionError(str(exc)) from None

    def register(fn: Callable[..., Any]) -> WorkflowDef:
        wf_name = name if isinstance(name, str) else fn.__name__
        params = list(inspect.signature(fn).parameters.values())
        if not 1 <= len(params) <= 2:
            raise DefinitionError(f"workflow {wf_name!r} ({_where(fn)}) must take (ctx) or "
                                  f"(ctx, input)")
        input_param = params[1].name if len(params) == 2 else None
        default = None
        if input_param is not None and params[1].default is not inspect.Parameter.empty:
            try:
                default = msgspec.json.encode(params[1].default)
            except (TypeError, msgspec.EncodeError) as exc:
                raise DefinitionError(f"workflow {wf_name!r} ({_where(fn)}): the default of "
                                      f"its input {input_param!r} is not JSON: {exc}") from None
        definition = WorkflowDef(wf_name, fn, input_param, queue, timeout_s, max_deliveries,
                                 retention_s, concurrency=concurrency or 0,
                                 concurrency_key=concurrency_key, priority=priority,
                                 input_default=default, tags=declared_tags,
                                 _version=version, current=current, retry=retry,
                                 on_exhausted=on_exhausted)
        from ..flow.gate_specs import GateSpecError, gate_of

        try:
            definition.gate = gate_of(
                debounce=debounce, debounce_key=debounce_key, debounce_max=debounce_max,
                debounce_reduce=debounce_reduce, throttle=throttle, throttle_key=throttle_key,
                singleton=singleton, singleton_key=singleton_key,
                takes_input=input_param is not None)
        except GateSpecError as exc:
            raise DefinitionError(f"workflow {wf_name!r} ({_where(fn)}): {exc}") from None
        if rate_limit is not None:
            from ..flow.rate_specs import as_rate

            definition.rate_limit, definition.rate_key = as_rate(rate_limit), rate_key
        if isinstance(rate_key, str) and input_param is None:
            raise DefinitionError(f"workflow {wf_name!r} ({_where(fn)}): rate_key "
                                  f"{rate_key!r} names an input field, but it takes no input")
        if concurrency_key is not None and input_param is None:
            raise DefinitionError(f"workflow {wf_name!r} ({_where(fn)}): concurrency_key "
                                  f"{concurrency_key!r} names an input field, but it takes "
                                  f"no input")
        REGISTRY.add_workflow(definition)
        return definition

    if callable(name):
        return register(name)
    return register


def _check_policy(retry: Any, on_exhausted: Any, where: str) -> None:
    from .retry_policy import RetryPolicyError, check_exhausted, check_retry

    try:
        check_retry(retry, where)
        check_exhausted(on_exhausted, where)
    except RetryPolicyError as exc:
        raise DefinitionError(str(exc)) from None


def load_source(source: str) -> list[str]:
    """Import a module path (``pkg.mod``), a file, or every module in a folder (sorted,
    skipping names that start with ``_`` or ``.``). Returns the modules imported."""
    if not source.strip():
        # Path("") is the working directory: an empty entry (a stray ":" in --source) would
        # import, and so run, every module below wherever the process was started.
        raise DefinitionError("empty --source entry (a stray ':'?): name a module, a file or "
                              "a folder")
    modules = _import_source(source)
    REGISTRY.check_versions()
    return modules


def _import_source(source: str) -> list[str]:
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.py") if not any(
            part.startswith(("_", ".")) for part in p.relative_to(path).parts))
        return [_import_file(f, path) for f in files]
    if path.suffix == ".py":
        if not path.is_file():
            raise DefinitionError(f"source file {source!r} does not exist")
        return [_import_file(path, path.parent)]
    try:
        importlib.import_module(source)
    except ImportError as exc:
        raise DefinitionError(f"cannot import source {source!r}: {exc}") from None
    return [source]


def _import_file(file: Path, root: Path) -> str:
    rel = file.relative_to(root).with_suffix("")
    module_name = "marbles_source." + ".".join(rel.parts)
    loaded = sys.modules.get(module_name)
    if loaded is not None and _same_file(loaded, file):
        return module_name  # the same file again
    if loaded is not None:
        # Another file with this name (a/flows.py and b/flows.py): it must load too,
        # under a name of its own, instead of being taken for the one already loaded.
        digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:10]
        module_name = f"{module_name}_{digest}"
        if module_name in sys.modules:
            return module_name
    if str(root.resolve()) not in sys.path:
        sys.path.insert(0, str(root.resolve()))  # so sources can import their siblings
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise DefinitionError(f"cannot load {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except DefinitionError:
        del sys.modules[module_name]
        raise
    except Exception as exc:
        del sys.modules[module_name]
        raise DefinitionError(f"loading {file} failed: {type(exc).__name__}: {exc}") from None
    return module_name


def _same_file(module: Any, file: Path) -> bool:
    origin = getattr(module, "__file__", None)
    return origin is not None and Path(origin).resolve() == file.resolve()
