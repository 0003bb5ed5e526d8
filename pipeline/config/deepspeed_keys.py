"""DeepSpeed's own config sections, checked before launch the way the pinned DeepSpeed reads them.

DeepSpeed silently ignores a key it never looks up (a misspelled `gradient_clipping` trains with the
default clipping), and what it does refuse (its pydantic sections, optimizer and scheduler arguments)
it refuses only once the engine starts, as a traceback on every rank. Nothing here is a hand-kept
list of keys: DeepSpeedConfig parses the run's sections from a dict that records every key it looks
up, so a key it never looked at is one it does not know; its pydantic sections validate themselves;
optimizer and scheduler arguments are compared with the signatures of the classes it will build
(pipeline/config/deepspeed_arguments.py).

Values are held to the JSON type DeepSpeed reads them as, as strictly as fathom's own keys
(common.sections.check_value): its pydantic sections would otherwise convert "1", true and 1.0 to a
ZeRO stage and "false" to true, and what it reads with a default it uses as given (a string where it
expects true or false failed inside its arithmetic, naming no key). A value read with a default must be
of the default's type; one a pydantic section read must be of the type the section made of it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from typing import Any

from fathom.common.errors import ConfigError, closest
from fathom.common.sections import check_value
from fathom.pipeline.config.deepspeed_arguments import check_constructor_args

# Read outside DeepSpeedConfig, by deepspeed.initialize itself (deepspeed/__init__.py, 0.19.8).
READ_BY_INITIALIZE = frozenset({"sequence_parallel_size", "data_parallel_size"})
# Sections fathom checks itself (pipeline: pipeline/config/run_config.py), or hands to a constructor (params).
OWN_CHECKS = frozenset({"pipeline", "optimizer.params", "scheduler.params"})


class Recording(dict):
    """A config section that notes the keys looked up in it, and whether it was read whole."""

    def __init__(self, data: dict, path: str = "", seen: dict[str, set[str]] | None = None):
        self.path, self.seen = path, {} if seen is None else seen
        self.seen.setdefault(path, set())
        super().__init__(
            {k: Recording(v, self._child(k), self.seen) if isinstance(v, dict) else v for k, v in data.items()}
        )

    def _child(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else str(key)

    def _note(self, key: Any) -> None:
        self.seen[self.path].add(key)

    def __getitem__(self, key: Any) -> Any:
        self._note(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._note(key)
        value = super().get(key, default)
        # A default of a JSON scalar type says what DeepSpeed computes with. (A string default may be a
        # placeholder for values of other types, such as data_types.keep_in_fp32_modules' "auto".)
        if dict.__contains__(self, key) and isinstance(default, bool | int | float):
            check_value(value, type(default), self._child(key))
        return value

    def __contains__(self, key: object) -> bool:
        self._note(key)
        return super().__contains__(key)

    def __iter__(self):  # noqa: ANN204 (iterated over: a pydantic model, a ** expansion; every key handed on)
        self.seen[self.path].update(dict.keys(self))
        return super().__iter__()

    # Views through the methods above: `key in d.keys()` notes one key, iterating notes them all.
    def keys(self) -> KeysView:
        return KeysView(self)

    def items(self) -> ItemsView:
        return ItemsView(self)

    def values(self) -> ValuesView:
        return ValuesView(self)

    def __copy__(self) -> Recording:
        twin = Recording.__new__(Recording)
        dict.update(twin, dict.items(self))
        twin.path, twin.seen = self.path, self.seen
        return twin


def pipeline_defaults() -> dict[str, Any]:
    """The pipeline section's keys and DeepSpeed's defaults: DeepSpeedConfig's (it takes the section whole,
    over its defaults, so it refuses none) and use_reentrant, which PipelineEngine reads itself (fathom's
    value where a config leaves it out is in pipeline/config/engine_defaults.py). `partition` is fathom's too."""
    from deepspeed.runtime.config import get_pipeline_config

    return {**get_pipeline_config({}), "use_reentrant": True}


def probe_config(ds: dict[str, Any]) -> dict[str, Any]:
    """A copy of `ds` DeepSpeedConfig can parse before launch. DeepSpeed checks the batch sizes against the
    size of whatever process group exists (none before launch: it assumes 1), and derives train_batch_size
    when it is left out; pipeline/config/deepspeed_values.py checks it against the real data-parallel size."""
    probe = copy.deepcopy(ds)
    if "train_micro_batch_size_per_gpu" in probe:
        probe.pop("train_batch_size", None)
    return probe


def check_deepspeed_keys(ds: dict[str, Any], our_sections: tuple[str, ...]) -> None:
    """Every key of DeepSpeed's sections is one the pinned DeepSpeed reads, with a value it accepts."""
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = probe_config(ds)
    recording = Recording(probe)
    with pydantic_reads() as reads:
        try:
            DeepSpeedConfig(recording)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 (whatever DeepSpeed raises becomes one line)
            check_read_types(reads, recording)  # a value of another type may be what it failed on
            raise ConfigError(deepspeed_error(err, probe, ds)) from None
    for path, value in sections(ds):
        if path in OWN_CHECKS or not isinstance(value, dict):
            continue
        known = recording.seen.get(path, set())
        if path and not known:  # handed whole to a pydantic model, which refuses unknown keys itself
            continue
        if path == "":
            known = known | READ_BY_INITIALIZE | set(our_sections)
        for key in value:
            if key in known:
                continue
            if not path:
                raise ConfigError(
                    f"{key}: neither a section of fathom's ({', '.join(our_sections)}) nor a key DeepSpeed reads"
                    f"{closest(key, known)}"
                )
            raise ConfigError(f"{path}.{key}: not a key DeepSpeed reads (it would ignore it){closest(key, known)}")
    check_read_types(reads, recording)
    check_constructor_args(ds)


@contextlib.contextmanager
def pydantic_reads() -> Iterator[list[tuple[dict[str, Any], Any]]]:
    """(the keyword arguments, the model built) of every pydantic section DeepSpeed builds meanwhile: what
    it read, and what it made of each value."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    reads: list[tuple[dict[str, Any], Any]] = []
    original = DeepSpeedConfigModel.__init__

    def recorded(self: Any, strict: bool = False, **data: Any) -> None:
        original(self, strict, **data)
        reads.append((data, self))

    DeepSpeedConfigModel.__init__ = recorded
    try:
        yield reads
    finally:
        DeepSpeedConfigModel.__init__ = original


def check_read_types(reads: list[tuple[dict[str, Any], Any]], recording: Recording) -> None:
    """Every value a pydantic section read is of the JSON type the section made of it (an integer stays
    an integer, true or false a bool), or a ConfigError naming its key."""
    nodes = recordings(recording)
    for data, model in reads:
        # The section the arguments came from: the one holding these very values (a section read whole
        # is handed on as **section); a section DeepSpeed assembles itself (its monitors) holds sections.
        parent = next((node.path for node in nodes if same_items(node, data)), None)
        check_model_types(data, model, parent)


def recordings(node: Recording) -> list[Recording]:
    """`node` and every section in it, read without noting a key."""
    found = [node]
    for value in dict.values(node):
        if isinstance(value, Recording):
            found += recordings(value)
    return found


def same_items(node: Recording, data: dict[str, Any]) -> bool:
    return dict.keys(node) == data.keys() and all(dict.__getitem__(node, k) is v for k, v in data.items())


def check_model_types(raw: dict[str, Any], model: Any, path: str | None) -> None:
    fields = type(model).model_fields
    for key, value in dict.items(raw):
        name = next((name for name, field in fields.items() if key in (name, field.alias)), None)
        read = getattr(model, name, None) if name is not None else None  # a deprecated field is removed
        check_read_as(value, read, f"{path}.{key}" if path else str(key))


def check_read_as(raw: Any, read: Any, key: str) -> None:
    """The config's value `raw` against what a pydantic section made of it, `read`."""
    from pydantic import BaseModel

    if isinstance(read, BaseModel):
        if isinstance(raw, dict):
            check_model_types(raw, read, key)
    elif isinstance(read, list | tuple):
        check_value(raw, list, key)
        for index, (item, read_item) in enumerate(zip(raw, read, strict=False)):
            check_read_as(item, read_item, f"{key}[{index}]")
    elif isinstance(read, dict) and isinstance(raw, dict):
        for item in raw.keys() & read.keys():
            check_read_as(raw[item], read[item], f"{key}.{item}")
    else:  # an enum's value (use_enum_values) or a subclass such as DeepSpeed's pp_int is its base type's
        scalar = next((tp for tp in (bool, int, float, str) if isinstance(read, tp)), None)
        if scalar is not None:
            check_value(raw, scalar, key)


def sections(ds: dict[str, Any], path: str = "") -> list[tuple[str, Any]]:
    """(dotted path, value) of the config and of each object in it."""
    found = [(path, ds)]
    for key, value in ds.items():
        if isinstance(value, dict):
            found += sections(value, f"{path}.{key}" if path else key)
    return found


def deepspeed_error(err: Exception, probe: dict[str, Any], ds: dict[str, Any]) -> str:
    """DeepSpeed's refusal of a section as one line naming the key."""
    from pydantic import ValidationError

    if isinstance(err, ValidationError):
        first = err.errors()[0]
        loc = [str(part) for part in first["loc"]]
        path = locate(ds, loc) or ".".join(loc)
        if first["type"] == "extra_forbidden":
            return f"{path}: not a key DeepSpeed knows{closest(loc[-1], model_fields(err.title, loc[:-1]))}"
        return f"{path}: {first['msg']} (got {first.get('input')!r})"
    if isinstance(err, TypeError) and (section := scalar_section(probe)) is not None:
        return f"{section}: DeepSpeed reads it as an object ({{...}}), got {ds[section]!r}"
    return f"DeepSpeed refuses the config: {str(err).strip().split(chr(10))[0]}"


def scalar_section(probe: dict[str, Any]) -> str | None:
    """The top-level key given a plain value where DeepSpeed unpacks an object (e.g. zero_optimization=1):
    the one whose replacement by {} makes DeepSpeedConfig's TypeError go away."""
    from deepspeed.runtime.config import DeepSpeedConfig

    for key, value in probe.items():
        if isinstance(value, dict):
            continue
        try:
            DeepSpeedConfig({**probe, key: {}})
        except TypeError:
            continue
        except Exception:  # noqa: BLE001 (past the TypeError: that key was it)
            return key
        return key
    return None


def locate(ds: dict[str, Any], loc: list[str]) -> str | None:
    """The dotted path of the section holding `loc` (pydantic names keys from its own model down)."""
    for path, value in sections(ds):
        node = value
        for part in loc[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and loc[-1] in node:
            return ".".join(filter(None, [path, *loc]))
    return None


def model_fields(title: str, loc: list[str]) -> set[str]:
    """The field names (and aliases) of DeepSpeed's pydantic model `title`, or of its sub-model at `loc`."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    def subclasses(cls: type) -> list[type]:
        return [cls] + [s for sub in cls.__subclasses__() for s in subclasses(sub)]

    model = next((cls for cls in subclasses(DeepSpeedConfigModel) if cls.__name__ == title), None)
    for part in loc:
        field = None if model is None else model.model_fields.get(part)
        model = None if field is None else next(iter(submodels(field.annotation)), None)
    if model is None:
        return set()
    return {name for key, field in model.model_fields.items() for name in (key, field.alias) if name}


def submodels(annotation: Any) -> list[type]:
    from pydantic import BaseModel

    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in submodels(arg)]
