"""An example third-party mtpflow plugin.

It registers exactly as mtpflow's built-ins do, through the ``mtpflow``
entry-point group (see this folder's ``pyproject.toml``):

* a drafter kind ``echo`` that needs no model: it proposes the last token
  repeated (``--draft-kind echo``).  It is right whenever the target repeats
  itself, so it exercises partial and full acceptance and rollback;
* an ``mtpflow_emit`` observer that counts rounds and emitted tokens.
"""

from __future__ import annotations

from mtpflow import hookimpl

__version__ = "0.1.0"

#: what the emit observer saw: {"rounds": int, "tokens": int}
SEEN = {"rounds": 0, "tokens": 0}


class EchoDrafter:
    """Drafts the token it was fed, ``n_draft`` times."""

    model_types = ()  # loads no checkpoint
    needs = frozenset()  # reads nothing from the target

    @classmethod
    def load(cls, path, target, options):
        return cls()

    def propose(self, session, state, shared, n_draft):
        import mlx.core as mx

        from mtpflow.state import DraftBlock

        tokens = mx.repeat(shared.last_tokens[:, None], n_draft, axis=1)
        return DraftBlock(tokens=tokens, n_draft=n_draft)


@hookimpl
def mtpflow_register_drafters(register):
    register("echo", EchoDrafter)


@hookimpl
def mtpflow_emit(session, record, emitted):
    SEEN["rounds"] += 1
    SEEN["tokens"] += sum(len(t) for t in emitted.values())
