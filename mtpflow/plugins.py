"""Plugin manager and registries.

Loading order: the built-in plugins (the modules named in the ``mtpflow``
entry-point group of mtpflow's own ``pyproject.toml``), then third-party
packages of the same entry-point group, then modules named in configs.

Operators control loading with environment variables:

* ``MTPFLOW_PLUGINS`` -- comma-separated allow list of third-party plugin
  names; unset means "all installed".
* ``MTPFLOW_BLOCK_PLUGINS`` -- comma-separated block list.
* ``MTPFLOW_DISABLE_PLUGIN_AUTOLOAD=1`` -- load no third-party entry points
  (the test suite sets this); built-ins still load.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import warnings
from importlib import metadata
from typing import Any, Callable

import attrs
import pluggy

from . import hookspecs

ENTRY_POINT_GROUP = "mtpflow"

#: The built-in plugins, exactly as listed in mtpflow's entry-point group.
BUILTIN_PLUGINS: dict[str, str] = {
    "heads": "mtpflow.builtins.heads",
    "samplers": "mtpflow.builtins.samplers",
    "drafters": "mtpflow.builtins.drafters",
    "policies": "mtpflow.builtins.policies",
    "targets": "mtpflow.builtins.targets",
    "stages": "mtpflow.builtins.stages",
}


class PluginError(Exception):
    """A plugin is missing, broken, or registered something invalid."""


class Registry:
    """Name -> object, owned by the host.  ``register`` is handed to plugins;
    what it accepts is the kind's protocol (:data:`mtpflow.api.KINDS`)."""

    def __init__(self, kind: str):
        from .api import KINDS

        self.kind = kind
        self.spec = KINDS[kind]
        self._items: dict[str, Any] = {}
        self._owner: dict[str, str] = {}
        self._current_plugin = "?"

    def register(self, name: str, obj: Any) -> None:
        from .api import check_needs

        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {self._current_plugin!r}: {self.kind} name must be a non-empty string")
        if name in self._items:
            raise PluginError(
                f"plugin {self._current_plugin!r} registers {self.kind} {name!r}, "
                f"already registered by plugin {self._owner[name]!r}"
            )
        missing = self.spec.missing(obj)
        if missing:
            what = self.spec.registered.__name__ if self.spec.registered is not None else "a factory"
            raise PluginError(
                f"plugin {self._current_plugin!r}: {self.kind} {name!r} lacks required "
                f"attribute(s) {', '.join(missing)} (see mtpflow.api.{what})"
            )
        if self.kind == "drafters":
            why = check_needs(obj.needs)
            if why:
                raise PluginError(f"plugin {self._current_plugin!r}: drafters {name!r}: {why}")
        settings = getattr(obj, "settings", None)
        if settings is not None and not attrs.has(settings):
            raise PluginError(
                f"plugin {self._current_plugin!r}: {self.kind} {name!r}: settings must be an attrs class, got {settings!r}"
            )
        self._items[name] = obj
        self._owner[name] = self._current_plugin

    def forget(self, plugin: str) -> None:
        """Drop every name ``plugin`` registered."""
        for name in [n for n, owner in self._owner.items() if owner == plugin]:
            del self._items[name], self._owner[name]

    def get(self, name: str) -> Any:
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "none"
            raise PluginError(f"unknown {self.spec.singular} {name!r} (registered: {known})") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def owner(self, name: str) -> str:
        return self._owner[name]

    def items(self):
        return sorted(self._items.items())

    def __contains__(self, name: str) -> bool:
        return name in self._items


class Plugins:
    """The loaded plugin manager plus the filled registries."""

    def __init__(self, pm: pluggy.PluginManager, registries: dict[str, Registry], versions: dict[str, str]):
        self.pm = pm
        self.hook = pm.hook
        self.registries = registries
        self.versions = versions

    def __getattr__(self, kind: str) -> Registry:
        try:
            return self.__dict__["registries"][kind]
        except KeyError:
            raise AttributeError(kind) from None

    # -- settings ----------------------------------------------------------------
    def settings_for(self, name: str, obj: Any, config) -> Any:
        """The validated settings instance for the object registered as
        ``name`` (its ``settings`` attrs class, from ``[plugins.NAME]``), or
        ``None`` when it declares no settings."""
        from .config import ConfigError, structure_settings

        cls = getattr(obj, "settings", None)
        table = config.plugins.settings.get(name) if config is not None else None
        if cls is None:
            if table:
                raise ConfigError(f"$.plugins.{name}: the plugin registered as {name!r} takes no settings")
            return None
        return structure_settings(cls, table or {}, f"$.plugins.{name}")

    def check_settings(self, config) -> None:
        """Every ``[plugins.NAME]`` table names a registered object and is valid for it."""
        from .config import ConfigError

        for name in config.plugins.settings:
            owners = [reg for reg in self.registries.values() if name in reg]
            if not owners:
                known = sorted({n for reg in self.registries.values() for n in reg.names() if getattr(reg.get(n), "settings", None)})
                raise ConfigError(
                    f"$.plugins.{name}: no plugin registered {name!r}; names that take settings: {', '.join(known) or 'none'}"
                )
            for reg in owners:
                self.settings_for(name, reg.get(name), config)

    def build(self, kind: str, name: str, config, *args, **kwargs):
        """Call the factory registered as ``name`` in ``kind`` with ``args``,
        adding ``settings=`` when it declares settings."""
        factory = self.registries[kind].get(name)
        settings = self.settings_for(name, factory, config)
        if settings is not None:
            kwargs["settings"] = settings
        obj = factory(*args, **kwargs)
        spec = self.registries[kind].spec
        missing = spec.missing(obj, spec.built) if spec.built is not None else []
        if missing:
            raise PluginError(
                f"plugin {self.registries[kind].owner(name)!r}: the {spec.singular} {name!r} built an object "
                f"lacking {', '.join(missing)} (see mtpflow.api.{spec.built.__name__})"
            )
        return obj

    def register(self, plugin: Any, name: str | None = None, version: str = "unknown") -> None:
        """Add ``plugin`` (a module or object with ``mtpflow_*`` hooks): its
        register hooks run now and fill the registries (they are historic),
        its round-stage hooks join the next round.  A plugin whose
        registrations fail is removed again and the error raised; a plugin
        implementing no mtpflow hook gets a warning (it can do nothing)."""
        for reg in self.registries.values():
            reg._current_plugin = name or "?"
        try:
            name = self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self._drop(plugin)
            raise PluginError(f"plugin {name!r} implements an unknown or invalid hook: {exc}") from exc
        except BaseException:
            self._drop(plugin)
            raise
        finally:
            for reg in self.registries.values():
                reg._current_plugin = "?"
        self.versions[name] = version
        if not self.pm.get_hookcallers(plugin):
            warnings.warn(_no_hooks_message(name, plugin), stacklevel=3)

    def _drop(self, plugin: Any) -> None:
        """Unregister ``plugin`` and forget what it registered."""
        name = self.pm.get_name(plugin)
        if name is None:
            return
        self.pm.unregister(plugin)
        for reg in self.registries.values():
            reg.forget(name)

    @contextlib.contextmanager
    def active(self):
        """Make these the plugins :func:`current_plugins` returns while a
        session loads (drafter checks and loaders look their target adapter
        up there, not in the process-wide manager)."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def describe(self) -> list[dict]:
        """JSON-ready list: name, version, hooks of every plugin (like ``llm
        plugins``), and per registry the names it registered."""
        out = []
        for name, plugin in sorted(self.pm.list_name_plugin(), key=lambda x: x[0]):
            if plugin is None:
                continue
            hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])
            registered = {}
            for kind, reg in sorted(self.registries.items()):
                names = [n for n in reg.names() if reg.owner(n) == name]
                if names:
                    registered[kind] = names
            out.append({"name": name, "version": self.versions.get(name), "hooks": hooks, "registered": registered})
        return out


def _no_hooks_message(name: str, plugin: Any) -> str:
    msg = f"mtpflow plugin {name!r} implements no mtpflow hook and does nothing"
    classes = [v for v in vars(plugin).values() if isinstance(v, type)] if isinstance(plugin, type(os)) else []
    if any(k.startswith("mtpflow_") for c in classes for k in vars(c)):
        return msg + "; its hooks are methods of a class: define them as module-level functions (see docs/plugins.md)"
    return msg + "; define module-level functions named mtpflow_* decorated with @hookimpl"


def _csv_env(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def _entry_points() -> list[metadata.EntryPoint]:
    eps = metadata.entry_points()
    return list(eps.select(group=ENTRY_POINT_GROUP))


def make_plugin_manager(extra: list[str | object] | None = None, *, autoload: bool | None = None) -> Plugins:
    """Build the plugin manager: built-ins, installed plugins, then ``extra``.

    ``extra`` holds plugin objects or importable module names (from a config);
    a failure there is an error naming the plugin.  A broken auto-discovered
    plugin is a warning and is skipped.  The registries are filled as each
    plugin is added (the register hooks are ``historic``), so
    :meth:`Plugins.register` adds a plugin later the same way.
    """
    from . import __version__
    from .api import KINDS

    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    registries = {kind: Registry(kind) for kind in KINDS}
    for kind, reg in registries.items():  # no plugin yet: every plugin added is called as it comes
        getattr(pm.hook, f"mtpflow_register_{kind}").call_historic(kwargs={"register": reg.register})
    plugins = Plugins(pm, registries, {})

    for name, modname in BUILTIN_PLUGINS.items():
        plugins.register(importlib.import_module(modname), name=name, version=__version__)

    if autoload is None:
        autoload = os.environ.get("MTPFLOW_DISABLE_PLUGIN_AUTOLOAD", "") not in ("1", "true", "yes")
    allow = _csv_env("MTPFLOW_PLUGINS")
    block = _csv_env("MTPFLOW_BLOCK_PLUGINS") or set()
    if autoload:
        for ep in _entry_points():
            if ep.name in BUILTIN_PLUGINS and ep.value == BUILTIN_PLUGINS[ep.name]:
                continue  # the built-ins, already registered above
            if ep.name in block or (allow is not None and ep.name not in allow):
                continue
            if pm.has_plugin(ep.name):
                warnings.warn(f"mtpflow plugin {ep.name!r} is installed twice; keeping the first", stacklevel=2)
                continue
            dist = getattr(ep, "dist", None)
            try:
                plugins.register(ep.load(), name=ep.name, version=getattr(dist, "version", None) or "unknown")
            except Exception as exc:  # a broken auto-discovered plugin must not break the host
                warnings.warn(f"mtpflow plugin {ep.name!r} failed to load and was skipped: {exc}", stacklevel=2)

    for item in extra or []:
        if isinstance(item, str):
            if item in block:
                raise PluginError(f"plugin {item!r} is named in the config but blocked by MTPFLOW_BLOCK_PLUGINS")
            if pm.has_plugin(item):
                continue  # named twice: loaded once
            try:
                mod = importlib.import_module(item)
            except Exception as exc:
                raise PluginError(f"plugin {item!r} named in the config could not be imported: {exc}") from exc
            if pm.is_registered(mod):
                continue  # an installed plugin, already loaded through its entry point
            try:
                plugins.register(mod, name=item, version=getattr(mod, "__version__", "unknown"))
            except PluginError:
                raise
            except Exception as exc:  # e.g. pluggy rejecting the module's hooks
                raise PluginError(f"plugin {item!r} named in the config could not be registered: {exc}") from exc
        else:
            name = getattr(item, "__name__", None) or type(item).__name__
            if not pm.is_registered(item):
                plugins.register(item, name=name, version=getattr(item, "__version__", "unknown"))
    return plugins


_default: Plugins | None = None
_ACTIVE: contextvars.ContextVar[Plugins | None] = contextvars.ContextVar("mtpflow_plugins", default=None)


def current_plugins() -> Plugins:
    """The plugins of the session being loaded (:meth:`Plugins.active`), else
    the process-wide ones."""
    return _ACTIVE.get() or get_plugins()


def get_plugins() -> Plugins:
    """The process-wide plugin manager (built on first use)."""
    global _default
    if _default is None:
        _default = make_plugin_manager()
    return _default


def reset_plugins() -> None:
    global _default
    _default = None


Register = Callable[[str, Any], None]
