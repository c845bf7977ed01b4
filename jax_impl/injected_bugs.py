"""Deliberate scheduler and serving bugs for jax_impl's HTTP server (python -m jax_impl.http_server --inject-bug NAME):
the kit's tests serve with each one and check that `qwen35-conformance check-server` catches it, naming a scenario
(conformance/INTERPRETING.md lists them with what catches each). Each is a Server subclass that changes one host-side
step the way a real engine's bug did; none is ever used without the flag."""

from .serving import Server

BUGS = {}


def bug(cls):
    BUGS[cls.__name__.replace("_", "-")] = cls
    return cls


def server_class(name):
    """The Server class to serve with: Server itself, or the named bug's."""
    if name is None:
        return Server
    if name not in BUGS:
        raise reference_error(name)
    return BUGS[name]


def reference_error(name):
    from .serving import UserError
    return UserError(f"--inject-bug {name}: expected one of {', '.join(sorted(BUGS))}")
