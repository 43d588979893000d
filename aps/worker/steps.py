"""The step server: a worker's envs, answering the learner's numbered requests exactly once.

A :class:`StepServer` lives as long as one worker session (it survives resumes, not a new
session). It answers resets, steps, rollouts and env calls by name (Gymnasium's ``call``,
``get_attr``, ``set_attr``, ``render``) with whole batches, one message per request, and
every kind of request a mode registered (:func:`aps.session.protocol.register_request`) with that
kind's handler; an env (or a mode's handler) that raises is reported to the learner as an
:class:`~aps.wire.messages.ErrorReport` and the server keeps serving. Every answer is kept,
encoded, until the learner acknowledges it, so that after a resume the learner gets the
answers it missed and no request runs twice.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from aps.errors import ApsError, ConfigError, ProtocolError, WireError
from aps.multiagent import MultiAgentVectorEnv
from aps.session import Session
from aps.session.delivery import ANSWERS, AnswerCache
from aps.session.protocol import REQUESTS
from aps.vector import AnyVectorEnv, EnvPoolVectorEnv
from aps.wire import codec
from aps.wire.batching import action_layout, check_batch
from aps.wire.messages import (
    TIMINGS_FORMAT,
    EnvCall,
    EnvCallResult,
    ErrorReport,
    GroupWeights,
    JoinWeightGroup,
    Message,
    Request,
    ResetRequest,
    ResetResult,
    RolloutChunk,
    RolloutRequest,
    StepRequest,
    StepResult,
    WeightGroupJoined,
    Weights,
)
from aps.wire.spaces import value_to_wire
from aps.worker.collector import Collector
from aps.worker.envs import WRAPPER_CLASSES, wrapper_classes
from aps.worker.fanout import GroupReceiver

__all__ = ["StepServer"]

_Handler = tuple[Callable[[Any], Any], bool]
"""A request kind's handler bound to one server, and whether it returns an awaitable."""


class StepServer:
    """Answers one session's requests with ``envs`` (and ``collector`` when the worker acts).

    Args:
        envs: the worker's vector env; the server closes it.
        collector: worker-side inference, when the learner named a policy.
        seed: the seed of the first reset when the learner resets without one.
    """

    def __init__(
        self,
        envs: AnyVectorEnv,
        collector: Collector | None,
        seed: int | None,
        *,
        allow_private_env_calls: bool = False,
    ) -> None:
        self.envs = envs
        self._allow_private = allow_private_env_calls
        self.collector = collector
        self._pending_seed = seed
        self._weights_error: ApsError | None = None
        self.learner_host = "127.0.0.1"
        """The host the worker reached the learner at (a weight group's default store host)."""
        self.max_frame_size = codec.DEFAULT_MAX_FRAME_SIZE
        """The session's frame limit, which a version from the weight group is held to."""
        self.weight_group: GroupReceiver | None = None
        self._answers: AnswerCache[tuple[Message, bytes, str]] = AnswerCache()
        # Seconds the previous answer took to encode: an answer carries its predecessor's
        # (its own is known only once it is encoded).
        self._encode_seconds = 0.0
        # What check_batch accepts for an array action space, worked out once: the actions
        # of every step are still checked against it (they come from the network).
        self._action_layout = action_layout(envs.single_action_space, envs.num_envs)
        # Each request kind's handler (aps.session.protocol.REQUESTS), bound once: the dispatch of a
        # request is one lookup. A kind registered after the server was built is bound when
        # its first request comes.
        self._handlers: dict[type[Message], _Handler] = {}
        for kind in REQUESTS:
            self._bind(kind)

    @property
    def served(self) -> int:
        """Requests of this session answered."""
        return self._answers.served

    @property
    def version(self) -> int:
        """The policy version the worker holds (-1: none, or no policy)."""
        return -1 if self.collector is None else self.collector.version

    def close(self) -> None:
        """Leave the weight group, if any, and close the envs."""
        if self.weight_group is not None:
            self.weight_group.close()
            self.weight_group = None
        self.envs.close()

    async def answer(self, session: Session, request: Request) -> bool:
        """Answer request ``seq`` once: run it, or send the kept answer if it already ran.

        Returns:
            Whether the answer was a kept one (sent again after a resume).

        Raises:
            ProtocolError: the learner skipped a request, or asked again for one whose answer
                it had acknowledged.
        """
        seq = request.seq
        kept = self._answers.lookup(seq, request.acked)
        if kept is not None:
            if not isinstance(kept[0], ANSWERS[type(request)] | ErrorReport):
                raise ProtocolError(
                    f"the learner asked again for answer {seq} as a {type(request).__name__}, "
                    f"but it was a {type(kept[0]).__name__}; the learner is not a compatible "
                    "aps learner"
                )
            # Encoded again if the connection that resumed encodes otherwise (another codec,
            # or frame delta where it was off, or the reverse).
            same = kept[2] == session.encoding
            await session.send(kept[0], frame=kept[1] if same else None)
            return True
        handler, awaits = self._handlers.get(type(request)) or self._bind(type(request))
        answer: Any = handler(request)
        if awaits:
            answer = await answer
        # Encoded once: the frame is what is sent, and what is kept for a resend.
        started = time.perf_counter()
        try:
            frame = session.encode(answer)
        except WireError as exc:
            if not isinstance(request, EnvCall):
                raise
            # What an env returns by name is the user's: a value that is not plain data is
            # their error to read, not the end of the session.
            answer = ErrorReport.of(
                ConfigError(
                    f"{request.kind}({request.name!r}) returned a value that cannot travel as "
                    f"data: {exc}; return plain data (numbers, strings, numpy arrays, tuples, "
                    "dicts with str keys), or read the value on the worker"
                ),
                seq,
            )
            frame = session.encode(answer)
        self._encode_seconds = time.perf_counter() - started
        self._answers.keep((answer, frame, session.encoding))
        await session.send(answer, frame=frame)
        return False

    def _bind(self, kind: type[Message]) -> _Handler:
        """The handler of ``kind``'s row, bound to this server (and kept)."""
        row = REQUESTS.get(kind)
        if row is None:
            raise ProtocolError(
                f"the learner sent a {kind.__name__}, which is no kind of request this worker "
                f"answers ({', '.join(sorted(k.__name__ for k in REQUESTS))}); register its "
                "mode on the worker too (import the module that calls register_request)"
            )
        serve = row.serve
        handler: Callable[[Any], Any]
        if isinstance(serve, str):
            handler = getattr(self, serve)  # a built-in kind: it reports its own errors
        else:
            handler = _reporting(serve, self)
        bound = (handler, inspect.iscoroutinefunction(handler))
        self._handlers[kind] = bound
        return bound

    def load_weights(self, weights: Weights) -> None:
        """Take a new policy version (weights have no answer: a bad one fails the next rollout)."""
        if self.collector is None:
            self._weights_error = ProtocolError(
                "the learner sent weights to a worker without a policy"
            )
            return
        try:
            self.collector.load(weights)
            self._weights_error = None
        except ApsError as exc:
            self._weights_error = exc

    def announce_weights(self, message: GroupWeights) -> None:
        """Join the weight group's collective that carries ``message.version``.

        A failure (no group, a bad announcement) fails the next rollout, as bad weights do.
        """
        try:
            if self.weight_group is None:
                raise ProtocolError(
                    f"the learner announced version {message.version} by a weight group this "
                    "worker is not a member of"
                )
            self.weight_group.announce(message)
        except ApsError as exc:
            self._weights_error = exc

    async def group_weights(self, weights: Weights) -> Weights | None:
        """The version ``Weights(version, arrays=None)`` names, from the weight group.

        ``None`` when it could not be had (the reason fails the next rollout).
        """
        try:
            if self.weight_group is None:
                raise ProtocolError(
                    f"the learner said to act with version {weights.version} from a weight "
                    "group this worker is not a member of"
                )
            return await self.weight_group.take(weights.version)
        except ApsError as exc:
            self._weights_error = exc
        except (RuntimeError, TimeoutError) as exc:
            self._weights_error = ProtocolError(
                f"version {weights.version} did not come by the weight group: {exc}"
            )
        return None

    async def _join_weight_group(self, request: JoinWeightGroup) -> WeightGroupJoined | ErrorReport:
        try:
            if self.weight_group is not None:
                self.weight_group.close()  # a learner forms a new group after one broke
                self.weight_group = None
            self.weight_group = await GroupReceiver.join(
                request, self.learner_host, self.max_frame_size
            )
        except Exception as exc:  # gloo's own errors included: the learner hears why
            return ErrorReport.of(exc, request.seq)
        return WeightGroupJoined(seq=request.seq)

    async def _rollout(self, request: RolloutRequest) -> RolloutChunk | ErrorReport:
        seq = request.seq
        if self.collector is None:
            return ErrorReport.of(
                ProtocolError(
                    "the learner asked for a rollout but gave this worker no policy; "
                    "create the learner with policy='module:factory'"
                ),
                seq,
            )
        if self._weights_error is not None:
            return ErrorReport.of(self._weights_error, seq)
        try:
            # Acted off the event loop: a new version keeps arriving meanwhile.
            chunk = await self.collector.collect_async(request.num_steps, seq)
        except Exception as exc:
            return ErrorReport.of(exc, seq)
        # The chunk's own packing (the collector's) and the previous answer's encoding.
        env, inference, packing = TIMINGS_FORMAT.unpack(chunk.timings or bytes(12))
        timings = TIMINGS_FORMAT.pack(env, inference, packing + self._encode_seconds)
        return dataclasses.replace(chunk, timings=timings)

    def _env_call(self, request: EnvCall) -> EnvCallResult | ErrorReport:
        # The base vector env: a wrapper (the rebuilding async one) does not forward by name.
        envs: Any = self.envs.unwrapped
        kind, name, indices = request.kind, request.name, request.indices
        values: Any
        try:
            if kind in ("call", "get_attr", "set_attr") and not self._allow_private:
                _check_public(kind, name, request.args, request.kwargs)
            if indices == ():
                values = ()
            elif isinstance(envs, MultiAgentVectorEnv) and (
                indices is not None or kind == "is_wrapped"
            ):
                values = self._each_slot(envs, request)
            elif kind == "is_wrapped" and getattr(envs, "envs", None) is None:
                values = self._is_wrapped_apart(envs, request)
            elif indices is not None or kind == "is_wrapped":
                values = self._each_env(envs, request)
            elif kind == "render":
                values = envs.render()
            elif not hasattr(envs, "call"):
                raise ConfigError(
                    f"{type(envs).__name__} cannot reach its envs by name ({kind}({name!r})); "
                    "run the worker with vector='sync' or 'async'"
                )
            elif kind == "set_attr":
                envs.set_attr(name, list(request.args[0]))
                values = (None,) * envs.num_envs
            elif kind == "get_attr":
                values = envs.get_attr(name)
            elif kind == "call":
                values = envs.call(name, *request.args, **(request.kwargs or {}))
            else:
                raise ProtocolError(f"the learner sent an env call of unknown kind {kind!r}")
            # Spaces, env specs and Generators as data (aps.wire.spaces.value_to_wire).
            values = tuple(value_to_wire(value) for value in values or ())
        except Exception as exc:
            return ErrorReport.of(exc, request.seq)
        return EnvCallResult(values=values, seq=request.seq)

    @staticmethod
    def _is_wrapped_apart(envs: Any, request: EnvCall) -> list[bool]:
        """``is_wrapped`` for envs this process does not hold: in subprocesses, or EnvPool's.

        Subprocess envs answer from the wrapper classes noted as they were built
        (:func:`aps.worker.envs.make_env`); EnvPool's envs are no Gymnasium envs, so no
        Gymnasium wrapper wraps them.
        """
        if isinstance(envs, EnvPoolVectorEnv):
            chains: Sequence[frozenset[str]] = (frozenset(),) * envs.num_envs
        else:
            try:
                chains = envs.get_attr(WRAPPER_CLASSES)
            except AttributeError as exc:
                raise ConfigError(
                    f"is_wrapped({request.name!r}) needs envs that noted their wrappers as "
                    f"they were built, and these ({type(envs).__name__}) did not ({exc}); "
                    "run the worker with vector='sync'"
                ) from exc
        chosen = range(len(chains)) if request.indices is None else request.indices
        return [request.name in chains[index] for index in chosen]

    @staticmethod
    def _each_slot(envs: MultiAgentVectorEnv, request: EnvCall) -> list[Any]:
        """``is_wrapped`` and reads of chosen slots of a multi-agent worker.

        A slot is an agent of an env copy: a read answers with its copy's attribute, and
        no Gymnasium wrapper wraps a PettingZoo env. Calls and writes on chosen slots are
        refused: two slots of one copy would call it, or set it, twice.
        """
        kind, name = request.kind, request.name
        chosen = range(envs.num_envs) if request.indices is None else request.indices
        if kind == "is_wrapped":
            return [False] * len(chosen)
        if kind != "get_attr":
            raise ConfigError(
                f"{kind}({name!r}) on chosen envs of a multi-agent worker would reach a copy "
                "once per agent slot; make the call on every env (indices=None), which "
                "reaches each copy once"
            )
        agents = envs.agents_per_env
        return [getattr(envs.envs[index // agents], name) for index in chosen]

    @staticmethod
    def _each_env(envs: Any, request: EnvCall) -> list[Any]:
        """An env call on chosen envs one by one: only a worker that holds its envs can."""
        kind, name = request.kind, request.name
        own: list[gym.Env[Any, Any]] | None = getattr(envs, "envs", None)
        if own is None:
            raise ConfigError(
                f"{kind}({name!r}) on chosen envs needs a worker that holds its envs in its own "
                f"process (vector='sync'), not {type(envs).__name__}"
            )
        chosen = range(len(own)) if request.indices is None else request.indices
        values: list[Any] = []
        for k, index in enumerate(chosen):
            env = own[index]
            if kind == "is_wrapped":
                values.append(name in wrapper_classes(env))
            elif kind == "render":
                values.append(env.render())
            elif kind == "set_attr":
                env.set_wrapper_attr(name, request.args[0][k])
                values.append(None)
            elif kind == "get_attr":
                values.append(env.get_wrapper_attr(name))
            elif kind == "call":
                function = env.get_wrapper_attr(name)
                values.append(
                    function(*request.args, **(request.kwargs or {}))
                    if callable(function)
                    else function
                )
            else:
                raise ProtocolError(f"the learner sent an env call of unknown kind {kind!r}")
        return values

    def _step(self, request: StepRequest) -> StepResult | ErrorReport:
        envs = self.envs
        actions = request.actions
        layout = self._action_layout
        # check_batch's test for an array space, written out (an array that passes is
        # returned as it is); anything else gets check_batch itself, and its error.
        if not (
            layout is not None
            and type(actions) is np.ndarray
            and actions.shape == layout[0]
            and actions.dtype.kind in layout[1]
        ):
            try:
                actions = check_batch(envs.single_action_space, actions, envs.num_envs)
            except ConfigError as exc:
                return ErrorReport.of(
                    ProtocolError(f"the learner sent bad actions: {exc}"), request.seq
                )
        started = time.perf_counter()
        try:
            obs, reward, terminated, truncated, info = envs.step(actions)
        except Exception as exc:
            return ErrorReport.of(exc, request.seq)
        env_seconds = time.perf_counter() - started
        if self.collector is not None:
            self.collector.observe(obs, terminated | truncated, info)
        return StepResult(
            obs=obs,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            info=info,
            seq=request.seq,
            timings=TIMINGS_FORMAT.pack(env_seconds, 0.0, self._encode_seconds),
        )

    def _reset(self, request: ResetRequest) -> ResetResult | ErrorReport:
        seed: int | list[int | None] | None
        if request.seeds is not None:
            seed = list(request.seeds)  # one per env
        else:
            seed = request.seed if request.seed is not None else self._pending_seed
        self._pending_seed = None
        options = dict(request.options) if request.options is not None else None
        started = time.perf_counter()
        try:
            obs, info = self.envs.reset(seed=seed, options=options)  # type: ignore[arg-type]
        except Exception as exc:
            return ErrorReport.of(exc, request.seq)
        env_seconds = time.perf_counter() - started
        if self.collector is not None:
            self.collector.observe(obs, None, info)
            first = seed[0] if isinstance(seed, list) else seed
            if first is not None:
                # Seeded resets make the worker's action sampling reproducible too.
                self.collector.policy.seed(first)
        return ResetResult(
            obs=obs,
            info=info,
            seq=request.seq,
            timings=TIMINGS_FORMAT.pack(env_seconds, 0.0, self._encode_seconds),
        )


def _reporting(serve: Callable[[Any, Any], Any], server: StepServer) -> Callable[[Any], Any]:
    """A mode's handler bound to ``server``, with what it raises sent as an ErrorReport."""
    if inspect.iscoroutinefunction(serve):

        async def answer_async(request: Any) -> Message:
            try:
                answer: Message = await serve(server, request)
            except Exception as exc:
                return ErrorReport.of(exc, request.seq)
            return answer

        return answer_async

    def answer(request: Any) -> Message:
        try:
            answer: Message = serve(server, request)
        except Exception as exc:
            return ErrorReport.of(exc, request.seq)
        return answer

    return answer


def _check_public(kind: str, name: str, args: Any, kwargs: Any) -> None:
    """Refuse an env call by a private (``_x``) or dunder name, however the name was passed.

    A learner holding the token would otherwise reach ``__class__``, ``__dict__``,
    ``_np_random`` and every internal of the worker's envs by name, directly or through
    Gymnasium's own lookups by name (``get_wrapper_attr`` and its kin). For those the name
    checked is the one the lookup resolves: its first positional argument or its ``name``
    keyword, as Python binds them; a lookup whose name is missing, passed twice or not a
    ``str`` is refused too, rather than left to Gymnasium to interpret.
    """
    if kind == "call" and name in _LOOKUPS_BY_NAME:
        kind, name = f"call({name!r}, ...)", _looked_up(name, args, kwargs)
    if name.startswith("_"):
        raise ConfigError(
            f"the learner asked for {kind}({name!r}), a private or dunder name, which this "
            "worker refuses: env calls reach public names only, unless the worker's operator "
            "allows more (aps worker --allow-private-env-calls, "
            "Worker(allow_private_env_calls=True))"
        )


def _looked_up(lookup: str, args: Any, kwargs: Any) -> str:
    """The attribute name that Gymnasium's ``lookup(*args, **kwargs)`` would resolve."""
    positional = args[:1] if args else ()
    keyword = (kwargs["name"],) if kwargs and "name" in kwargs else ()
    names = (*positional, *keyword)
    if len(names) != 1 or type(names[0]) is not str:
        raise ConfigError(
            f"the learner called {lookup} with the attribute name given as {names!r}; "
            "it takes exactly one name, a str, positionally or as name="
        )
    return names[0]


_LOOKUPS_BY_NAME = frozenset({"get_wrapper_attr", "set_wrapper_attr", "has_wrapper_attr"})
