"""The NIGT outer loop on flat float64 parameter vectors, and named arrays <-> one vector.

NIGT (normalized SGD with implicit gradient transport, in ascent form) keeps the current
parameters ``theta_t``, the previous ones ``theta_{t-1}`` and a momentum direction ``d``. Each
round, workers sample and differentiate at the *extrapolated* point

    theta~_t = theta_t + ((1 - eta) / eta) (theta_t - theta_{t-1})

and the learner folds the aggregated gradient ``g_t`` (measured at ``theta~_t``) into ``d`` and
takes a step of fixed length ``alpha``:

    d_t         = g_0                            on the first step (the initial batch)
    d_t         = (1 - eta) d_{t-1} + eta g_t    afterwards
    theta_{t+1} = theta_t + alpha d_t / ||d_t||  (ascent; ||.|| is the global Euclidean norm)

``eta = 1`` is normalized minibatch policy gradient: no momentum and no extrapolation.

Everything here is pure numpy on one flat vector: :class:`NIGTUpdate` holds the parameters
(``lr`` = alpha, ``momentum`` = eta), :class:`NIGTState` is an immutable snapshot that the
caller keeps and replaces. Torch state dicts travel as dicts of named arrays;
:func:`flatten` turns one into a vector and a :class:`Layout`, and :func:`unflatten` turns a
vector back into arrays with the original names, shapes and dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from aps.errors import ConfigError

__all__ = ["Layout", "NIGTState", "NIGTUpdate", "flatten", "unflatten"]

FloatVector = npt.NDArray[np.float64]

# bool, signed and unsigned ints, floats: values float64 can carry (ints exactly up to 2**53).
_REAL_KINDS = frozenset("biuf")


def _frozen(array: FloatVector) -> FloatVector:
    array.setflags(write=False)
    return array


def _as_vector(value: object, what: str, size: int | None = None) -> FloatVector:
    """A fresh read-only float64 copy of a finite 1-D real array, or ConfigError."""
    array = np.asarray(value)
    if array.dtype.kind not in _REAL_KINDS:
        raise ConfigError(f"{what} must be a real numeric array, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ConfigError(
            f"{what} must be a 1-d vector, got shape {array.shape}; "
            "flatten named arrays with aps.pg.flatten first"
        )
    if size is not None and array.shape[0] != size:
        raise ConfigError(
            f"{what} has {array.shape[0]} entries, the parameters have {size}; "
            "flatten it with the layout of the parameters"
        )
    vector = np.array(array, dtype=np.float64, copy=True)
    if not np.isfinite(vector).all():
        bad = int(np.flatnonzero(~np.isfinite(vector))[0])
        raise ConfigError(
            f"{what} has a non-finite entry ({vector[bad]} at index {bad}); "
            "check the rewards and the policy for overflow"
        )
    return _frozen(vector)


def _check_fraction(name: str, value: object, *, upper: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"NIGTUpdate({name}=...) must be a number, got {value!r}")
    number = float(value)
    ok = math.isfinite(number) and number > 0.0 and (upper is None or number <= upper)
    if not ok:
        limit = f"in (0, {upper:g}]" if upper is not None else "finite and > 0"
        raise ConfigError(f"NIGTUpdate({name}=...) must be {limit}, got {value!r}")
    return number


@dataclass(frozen=True, slots=True, eq=False)
class NIGTState:
    """One snapshot of the NIGT outer loop; never modified, replaced by each step.

    Build the first one with :meth:`NIGTUpdate.start`. All arrays are read-only float64
    vectors of the same length; copy one before modifying it.

    Attributes:
        theta: the current parameters ``theta_t``.
        theta_prev: the previous parameters ``theta_{t-1}`` (equal to ``theta`` before the
            first step, and after a step that did not move).
        direction: the momentum direction ``d_{t-1}`` the next step folds into; ``None``
            before the first step, when the next gradient becomes the direction as is.
        t: the number of steps taken. Round ``t`` samples at :attr:`point`; a natural round
            id for the aggregation rules of :mod:`aps.pg`.
        point: the extrapolated point ``theta~_t`` that workers must sample *and*
            differentiate at, the only vector broadcast; equal to ``theta`` before the first
            step and whenever ``eta == 1``.
        direction_norm: the global norm of the direction the last step used; ``0.0`` before
            the first step and after a step that did not move.
    """

    theta: FloatVector
    theta_prev: FloatVector
    direction: FloatVector | None
    t: int
    point: FloatVector
    direction_norm: float = 0.0

    @property
    def size(self) -> int:
        """The number of parameters."""
        return int(self.theta.shape[0])


@dataclass(frozen=True, slots=True)
class NIGTUpdate:
    """The NIGT update rule: normalized ascent steps with momentum at an extrapolated point.

    Holds only the two step parameters; the caller owns the :class:`NIGTState`. The loop a
    driver runs::

        rule = NIGTUpdate(lr=alpha, momentum=eta)
        state = rule.start(theta0)              # state.point == theta0, state.t == 0
        while ...:
            broadcast(state.point, round_id=state.t)
            g = aggregated gradient of round state.t (all measured at state.point)
            state = rule.step(state, g)

    Round 0 is the initial batch (``M_init`` gradients at ``theta_0``, e.g. a round of
    ``Rennala(batch=M_init)``); its gradient becomes the direction as is.

    Args:
        lr: the step length ``alpha`` (every step moves ``theta`` by exactly this Euclidean
            distance, unless the direction is zero). Finite and ``> 0``.
        momentum: ``eta``, the weight of the *new* gradient in the direction; the old direction
            keeps ``1 - eta``. In ``(0, 1]``; ``1`` gives normalized minibatch policy
            gradient with no extrapolation. The paper's grid is ``{0.001, 0.01, 0.1}``.

    Raises:
        ConfigError: ``lr`` not finite and ``> 0``, or ``momentum`` outside ``(0, 1]``.
    """

    lr: float
    momentum: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _check_fraction("lr", self.lr, upper=None))
        object.__setattr__(self, "momentum", _check_fraction("momentum", self.momentum, upper=1.0))

    @property
    def extrapolation(self) -> float:
        """The extrapolation factor ``(1 - eta) / eta`` (``0.0`` when ``eta == 1``)."""
        return (1.0 - self.momentum) / self.momentum

    def start(self, theta: npt.ArrayLike) -> NIGTState:
        """The state before the first step: ``theta_0``, no direction, ``point == theta_0``.

        Args:
            theta: the initial parameters as a 1-d real vector (copied to float64).

        Raises:
            ConfigError: ``theta`` is not a 1-d real vector, is empty, or has a non-finite
                entry.
        """
        vector = _as_vector(theta, "theta")
        if vector.shape[0] == 0:
            raise ConfigError("theta must have at least one entry, got an empty vector")
        return NIGTState(theta=vector, theta_prev=vector, direction=None, t=0, point=vector)

    def step(self, state: NIGTState, gradient: npt.ArrayLike) -> NIGTState:
        """Fold the aggregated gradient of round ``state.t`` in and take one normalized step.

        Computes, with ``eta = momentum`` and ``alpha = lr``::

            d           = gradient                             if state.direction is None
            d           = (1 - eta) state.direction + eta gradient   otherwise
            theta_next  = state.theta + alpha d / ||d||
            point_next  = theta_next + ((1 - eta) / eta) (theta_next - state.theta)

        ``||d||`` is the Euclidean norm of the whole flat vector (not per layer), computed
        with scaling so that it neither overflows nor underflows.

        Zero direction: when ``d`` is exactly zero there is no ascent direction, so the step
        does not move: ``theta_next == theta_prev_next == point_next == state.theta`` and
        ``direction_norm == 0.0``. The zero direction is kept as the momentum for the next
        step.

        Args:
            state: the current state (not modified).
            gradient: the aggregated gradient measured at ``state.point``, a 1-d real vector
                with ``state.size`` entries (an ascent direction: the gradient of the
                return, not of a loss).

        Returns:
            The next state, with ``t`` one higher.

        Raises:
            ConfigError: ``gradient`` has the wrong shape, a non-real dtype or a non-finite
                entry.
        """
        g = _as_vector(gradient, "gradient", state.size)
        eta = self.momentum
        if state.direction is None:
            d = g
        else:
            d = _frozen((1.0 - eta) * state.direction + eta * g)
        scale = float(np.max(np.abs(d)))
        if scale == 0.0:
            return NIGTState(
                theta=state.theta,
                theta_prev=state.theta,
                direction=d,
                t=state.t + 1,
                point=state.theta,
            )
        unit = d / scale
        norm = float(np.sqrt(np.dot(unit, unit)))
        theta_next = _frozen(state.theta + (self.lr / norm) * unit)
        factor = self.extrapolation
        if factor == 0.0:
            point = theta_next
        else:
            point = _frozen(theta_next + factor * (theta_next - state.theta))
        return NIGTState(
            theta=theta_next,
            theta_prev=state.theta,
            direction=d,
            t=state.t + 1,
            point=point,
            direction_norm=scale * norm,
        )


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each named array lives in a flat vector: names, shapes and dtypes, in order.

    Made by :func:`flatten`. Entry ``i`` occupies ``vector[offsets[i]:offsets[i] + n_i]``
    where ``n_i`` is the product of ``shapes[i]``, in C order.

    Attributes:
        names: the array names, in vector order (the order of the dict given to
            :func:`flatten`, which is a torch ``state_dict``'s order).
        shapes: each array's shape.
        dtypes: each array's dtype, restored by :func:`unflatten`.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype[Any], ...]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.shapes) == len(self.dtypes):
            raise ConfigError(
                f"Layout needs one shape and one dtype per name, got {len(self.names)} names, "
                f"{len(self.shapes)} shapes and {len(self.dtypes)} dtypes"
            )
        if len(set(self.names)) != len(self.names):
            raise ConfigError(f"Layout names must be unique, got {self.names}")

    @property
    def sizes(self) -> tuple[int, ...]:
        """The number of entries of each array."""
        return tuple(math.prod(shape) for shape in self.shapes)

    @property
    def size(self) -> int:
        """The length of the flat vector."""
        return sum(self.sizes)

    def _slices(self) -> Iterator[tuple[str, tuple[int, ...], np.dtype[Any], slice]]:
        offset = 0
        for name, shape, dtype, n in zip(
            self.names, self.shapes, self.dtypes, self.sizes, strict=True
        ):
            yield name, shape, dtype, slice(offset, offset + n)
            offset += n

    def flatten(
        self, arrays: Mapping[str, npt.ArrayLike], *, fill_missing: bool = False
    ) -> FloatVector:
        """Flatten arrays that follow this layout (gradients of the weights it came from).

        The vector follows the layout's order, whatever the order of ``arrays``. Dtypes need
        not match the layout's (float32 gradients of float32 weights become float64).

        Args:
            arrays: ``{name: array}`` with the layout's names and shapes.
            fill_missing: when ``True``, a name of the layout that ``arrays`` lacks is filled
                with zeros (the gradient of a buffer or a frozen parameter); when ``False`` (the
                default) it is an error.

        Returns:
            A fresh writable float64 vector of length :attr:`size`.

        Raises:
            ConfigError: a missing name (unless ``fill_missing``), an unexpected name, a shape
                that differs from the layout's, or a non-real dtype; the message lists them.
        """
        problems: list[str] = []
        unexpected = [name for name in arrays if name not in self.names]
        if unexpected:
            problems.append(f"unexpected {unexpected}")
        if not fill_missing:
            missing = [name for name in self.names if name not in arrays]
            if missing:
                problems.append(f"missing {missing} (pass fill_missing=True to zero them)")
        vector = np.zeros(self.size, dtype=np.float64)
        for name, shape, _, where in self._slices():
            if name not in arrays:
                continue
            array = np.asarray(arrays[name])
            if array.shape != shape:
                problems.append(f"{name!r} has shape {array.shape}, the layout's is {shape}")
            elif array.dtype.kind not in _REAL_KINDS:
                problems.append(f"{name!r} has dtype {array.dtype}, not a real number type")
            else:
                vector[where] = array.reshape(-1)
        if problems:
            raise ConfigError(
                "arrays do not follow the layout: "
                + "; ".join(problems)
                + "; they must have the names and shapes of the flattened weights"
            )
        return vector


def flatten(weights: Mapping[str, npt.ArrayLike]) -> tuple[FloatVector, Layout]:
    """Concatenate named arrays into one float64 vector, remembering how to undo it.

    Arrays are taken in the mapping's order, each in C order. Real dtypes only: floats, ints
    and bools (ints are exact up to ``2**53``); the NIGT step moves every entry along its
    direction, so an integer buffer stays unchanged only while its gradient entries are zero
    (see :meth:`Layout.flatten` with ``fill_missing=True``).

    Args:
        weights: ``{name: array}``, e.g. :meth:`aps.policy.Policy.get_weights`; may be empty.

    Returns:
        ``(vector, layout)``: a fresh writable float64 vector and the :class:`Layout` that
        :func:`unflatten` needs.

    Raises:
        ConfigError: an array with a non-real dtype (complex, object, strings).
    """
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    dtypes: list[np.dtype[Any]] = []
    parts: list[npt.NDArray[Any]] = []
    for name, value in weights.items():
        array = np.asarray(value)
        if array.dtype.kind not in _REAL_KINDS:
            raise ConfigError(
                f"weight {name!r} has dtype {array.dtype}; only bool, int and float arrays "
                "can be flattened"
            )
        names.append(name)
        shapes.append(tuple(int(n) for n in array.shape))
        dtypes.append(array.dtype)
        parts.append(array.reshape(-1))
    vector = np.zeros(sum(part.size for part in parts), dtype=np.float64)
    offset = 0
    for part in parts:
        vector[offset : offset + part.size] = part
        offset += part.size
    return vector, Layout(tuple(names), tuple(shapes), tuple(dtypes))


def unflatten(vector: npt.ArrayLike, layout: Layout) -> dict[str, npt.NDArray[Any]]:
    """Split a flat vector back into named arrays with the layout's shapes and dtypes.

    Float entries are cast (float64 to float32 rounds to nearest); integer and bool entries
    are rounded to the nearest integer first, so values that went through :func:`flatten`
    unchanged come back bit for bit.

    Args:
        vector: a 1-d real vector of length ``layout.size``, e.g. :attr:`NIGTState.point`.
        layout: from :func:`flatten`.

    Returns:
        ``{name: array}`` in the layout's order; each array is a fresh, writable,
        C-contiguous copy (safe to hand to torch).

    Raises:
        ConfigError: ``vector`` is not 1-d, not real, or has the wrong length.
    """
    array = np.asarray(vector)
    if array.dtype.kind not in _REAL_KINDS or array.shape != (layout.size,):
        raise ConfigError(
            f"cannot unflatten a {array.dtype} array of shape {array.shape}: the layout needs a "
            f"real 1-d vector of {layout.size} entries"
        )
    out: dict[str, npt.NDArray[Any]] = {}
    for name, shape, dtype, where in layout._slices():
        part = array[where]
        if dtype.kind in "biu" and array.dtype.kind == "f":
            part = np.rint(part)
        out[name] = np.array(part.reshape(shape), dtype=dtype, copy=True, order="C")
    return out
