"""Defining a package's ops once, for every package that compiles kernels with this builder.

``define_ops`` registers, in the package's torch.library namespace, every op's schema, its plain-
torch reference as the kernel for every device (CompositeExplicitAutograd), and its fake. On CUDA a
*loader* kernel stands in for each op until the package's compiled library is loaded: its first
call loads the library (prebuilt, cached, or compiled then under the OS lock); just before the
library is opened the loaders are dropped, so the library's own ``TORCH_LIBRARY_IMPL(<ns>, CUDA, m)``
registrations become the kernels, with no Python between the caller and the launcher. When the
library cannot be had the loaders stay and run the reference (after one warning; with
``APEX_STRICT_KERNELS=1`` they raise instead).

    OPS = define_ops("apex_norm", NORM_SPEC, SCHEMAS, references={...}, fakes={...})
    torch.ops.apex_norm.layer_norm_fwd(...)      # or OPS.ensure_loaded() to load eagerly

Never name a schema argument ``mode``: torch's Python dispatcher treats it specially.

torch 2.3 cannot functionalize an op that mutates a ``Tensor(a!)[]`` argument (its
auto_functionalize takes single tensors; lists came in 2.4), so torch.compile would fail on it.
There such ops are kept out of graphs (``torch._dynamo.disallow_in_graph``): torch.compile
breaks the graph around them and runs them eagerly, correctly; ``fullgraph=True`` needs 2.4.
Importing torch._dynamo costs seconds, so that is done when torch.compile imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import re
import sys
from collections.abc import Callable, Mapping

import torch

from . import loader
from .spec import KernelSpec

_register_fake = getattr(torch.library, "register_fake", None) or torch.library.impl_abstract


_MUTATES_A_LIST = re.compile(r"Tensor\([a-z]+!\)\[\]")


def mutates_a_list(schema: str) -> bool:
    """Whether ``schema`` mutates a ``Tensor[]`` argument in place."""
    return bool(_MUTATES_A_LIST.search(schema))


def functionalizes_lists() -> bool:
    """torch >= 2.4: torch.compile can trace ops that mutate Tensor[] arguments."""
    return hasattr(torch.library, "register_autograd")  # also new in 2.4, unlike a version parse


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once module ``name`` has been imported (at once if it already is)."""

    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback = name, callback

    @classmethod
    def call(cls, name: str, callback: Callable[[], None]) -> None:
        if name in sys.modules:
            callback()
        else:
            sys.meta_path.insert(0, cls(name, callback))

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then_call(module):
                exec_module(module)
                self.callback()

            spec.loader.exec_module = exec_then_call
        return spec


def _fake_none(*args, **kwargs):
    return None


class OpLibrary:
    """The ops of one namespace backed by one compiled library (see the module docstring)."""

    def __init__(
        self,
        namespace: str,
        spec: KernelSpec,
        schemas: Mapping[str, str],
        references: Mapping[str, Callable],
        fakes: Mapping[str, Callable] | None = None,
    ):
        missing = set(schemas) - set(references)
        if missing:
            raise ValueError(f"{namespace}: no reference for {sorted(missing)}")
        self.namespace = namespace
        self.spec = spec
        self.schemas = dict(schemas)
        self._references = dict(references)
        self._lib = torch.library.Library(namespace, "DEF")  # noqa: TOR901 - lives as long as the process
        self._loaders: torch.library.Library | None = None
        fakes = fakes or {}
        for name, schema in self.schemas.items():
            self._lib.define(schema)
            self._lib.impl(name, self._references[name], "CompositeExplicitAutograd")
            _register_fake(f"{namespace}::{name}", fakes.get(name, _fake_none), lib=self._lib)
        self._install_loaders()
        loader.register_pre_load(spec.name, self._drop_loaders)
        if not functionalizes_lists():
            _AfterImport.call("torch._dynamo", self._keep_list_mutations_out_of_graphs)

    def _keep_list_mutations_out_of_graphs(self) -> None:
        """torch 2.3 (see the module docstring)."""
        dynamo = sys.modules["torch._dynamo"]
        for name, schema in self.schemas.items():
            if mutates_a_list(schema):
                packet = getattr(getattr(torch.ops, self.namespace), name)
                dynamo.disallow_in_graph(packet)
                dynamo.disallow_in_graph(packet.default)

    def register_autograd(self, name: str, backward: Callable, setup_context: Callable) -> None:
        """Make op ``name`` differentiable: ``torch.library.register_autograd`` (torch >= 2.4).

        torch 2.3 lacks it: there an Autograd kernel runs the op below autograd inside an
        autograd.Function whose backward is ``backward``. Without one, 2.3's autograd fallback
        differentiates whatever ran below it (on CPU, the reference's own operations; CUDA
        kernels have no derivative) and warns that the result may be silently incorrect.
        """
        if hasattr(torch.library, "register_autograd"):
            torch.library.register_autograd(
                f"{self.namespace}::{name}", backward, setup_context=setup_context, lib=self._lib
            )
            return
        op = getattr(getattr(torch.ops, self.namespace), name).default
        arguments = op._schema.arguments

        def forward(ctx, *args):
            with torch._C._AutoDispatchBelowAutograd():
                output = op(*args)
            setup_context(ctx, args, output)
            return output

        function = type(
            f"{name}_autograd",
            (torch.autograd.Function,),
            {"forward": staticmethod(forward), "backward": staticmethod(backward)},
        )

        def autograd_kernel(*args):
            # The dispatcher drops trailing arguments equal to their defaults: put them back.
            args = (*args, *(a.default_value for a in arguments[len(args) :]))
            if torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args
            ):
                return function.apply(*args)
            with torch._C._AutoDispatchBelowAutograd():
                return op(*args)

        self._lib.impl(name, autograd_kernel, "Autograd")

    # -- the CUDA stand-ins ---------------------------------------------------------------------

    def _loader_kernel(self, name: str):
        ref = self._references[name]

        def load_then_call(*args):
            if self.ensure_loaded():
                return getattr(getattr(torch.ops, self.namespace), name).default(*args)
            return ref(*args)

        load_then_call.__name__ = f"{name}_load_then_call"
        return load_then_call

    def _install_loaders(self) -> None:
        if self._loaders is None:
            self._loaders = torch.library.Library(self.namespace, "IMPL")  # noqa: TOR901
            for name in self.schemas:
                self._loaders.impl(name, self._loader_kernel(name), "CUDA")

    def _drop_loaders(self) -> None:
        """Called by the builder right before the library is opened."""
        if self._loaders is not None:
            self._loaders._destroy()
            self._loaders = None

    def ensure_loaded(self) -> bool:
        """True once the compiled kernels are registered; False when on the reference path."""
        try:
            ext = loader.load(self.spec)
        finally:
            if loader.loaded(self.spec) is None:
                self._install_loaders()  # the library never opened: keep (or restore) the loaders
        return ext is not None


def define_ops(
    namespace: str,
    spec: KernelSpec,
    schemas: Mapping[str, str],
    references: Mapping[str, Callable],
    fakes: Mapping[str, Callable] | None = None,
) -> OpLibrary:
    """Define ``schemas`` in ``namespace`` with their references, fakes and CUDA loaders."""
    return OpLibrary(namespace, spec, schemas, references, fakes)
