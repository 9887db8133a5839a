"""Synthetic, verifiable RL tasks: an episode is an environment with a text-in/text-out step and a checked reward.

The first family is multi-turn tool use over small integers: the question is a nested expression such as
`mul(add(3,4),2)`, the episode offers only some of six tiny tools, the model calls them one at a time
(`call add 3 4` -> `7`), recovers from errors (`error: tool not found: ...`), and ends with `answer 14`;
the reward is 1 when the answer is right. Difficulty is the number of calls (1..4), and a DifficultySampler
serves the level at the model's frontier. Sources: Cursor's Composer 2.5 post (synthetic tasks, dynamic
difficulty, the "Tool not found" -> "Reminder: Available tools" feedback example); Toolformer (Schick et al.
2023) for text tool calls. Standard library only: no torch, nothing of the project.

    python tasks.py                # sample tasks, gold transcripts, one scripted episode, the sampler moving
"""

import argparse
import random
import re
import sys
from collections import deque
from dataclasses import dataclass
from typing import Optional, Protocol

# -----------------------------------------------------------------------------
# The interface every task family shares (tool use here; feature deletion on real codebases later).
# A trainer only needs: the opening turns, a step that maps the model's text to the environment's reply,
# and a verified reward once the episode is done.

Turn = tuple[str, str]  # (role, text), role in {"user", "assistant", "tool"}


class Env(Protocol):
    def first_turns(self) -> list[Turn]: ...
    def step(self, assistant_text: str) -> tuple[Optional[str], bool]: ...  # (reply or None, done)
    def reward(self) -> float: ...


def render(turns: list[Turn]) -> str:
    # The exact strings of model.SPECIALS; the tokenizer maps each to a single token.
    return "".join(f"<|{role}|>{text}<|end|>" for role, text in turns)


# -----------------------------------------------------------------------------
# Tools: tiny deterministic functions. Values stay in 0..99 so every number is at most two bytes.

TOOLS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
         "max": max, "min": min, "mod": lambda a, b: a % b}
MAX_DIFFICULTY = 4
CALL = re.compile(r"call ([a-z]{1,8}) (-?\d{1,6}) (-?\d{1,6})")  # bounded digits: no giant products
ANSWER = re.compile(r"answer (-?\d{1,6})")
MALFORMED = "error: malformed call. use: call TOOL A B, or answer N"


def not_found(name: str, tools: list[str]) -> str:
    return f"error: tool not found: {name}. available tools: {', '.join(tools)}"


@dataclass
class ToolTask:
    question: str                          # the first user turn: offered tools and the expression
    tools: list[str]                       # offered this episode, in TOOLS order (never all six)
    answer: int
    difficulty: int                        # number of tool calls the gold plan needs
    plan: list[tuple[str, int, int]]       # the gold calls, innermost first: (tool, a, b)


def make_tool_task(rng: random.Random, difficulty: int) -> ToolTask:
    if not 1 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"difficulty must be in 1..{MAX_DIFFICULTY}, got {difficulty}")
    value = rng.randint(1, 9)
    expr, plan = str(value), []
    while len(plan) < difficulty:
        name, leaf = rng.choice(list(TOOLS)), rng.randint(1, 9)
        # The running value goes left or right, so the model must find the innermost call, not just read left to right.
        a, b, ea, eb = (value, leaf, expr, str(leaf)) if rng.random() < 0.5 else (leaf, value, str(leaf), expr)
        if name == "mod" and b < 2:
            continue  # no division by zero, and mod 1 is a constant that ignores the chain
        result = TOOLS[name](a, b)
        if not 0 <= result <= 99:
            continue  # redraw: short numbers keep an episode inside the tiny model's context
        plan.append((name, a, b))
        value, expr = result, f"{name}({ea},{eb})"
    needed = {name for name, _, _ in plan}
    # Offer the needed tools plus distractors, difficulty + 1 in all, at most 5 of 6: some tool is always absent.
    extras = rng.sample(sorted(set(TOOLS) - needed), max(0, min(difficulty + 1, len(TOOLS) - 1) - len(needed)))
    tools = [t for t in TOOLS if t in needed or t in extras]
    return ToolTask(f"tools: {', '.join(tools)}. compute {expr}", tools, value, difficulty, plan)


# -----------------------------------------------------------------------------
# The environment: parses the model's message, runs the tool or reports the error, checks the answer.


class ToolEnv:
    def __init__(self, task: ToolTask, max_turns: int = 6):
        self.task, self.max_turns = task, max_turns
        self.turns: list[Turn] = self.first_turns()  # the whole episode so far, for rendering a rollout
        self.done, self.answer = False, None
        self.tool_calls = self.tool_errors = self.malformed = 0  # well-formed calls; absent tools; unparsable

    def first_turns(self) -> list[Turn]:
        return [("user", self.task.question)]

    def step(self, assistant_text: str) -> tuple[Optional[str], bool]:
        if self.done:
            raise RuntimeError("step() after the episode ended")
        self.turns.append(("assistant", assistant_text))
        text = assistant_text.strip()
        if m := ANSWER.fullmatch(text):
            self.answer, self.done = int(m.group(1)), True
            return None, True
        if m := CALL.fullmatch(text):
            self.tool_calls += 1
            name, a, b = m.group(1), int(m.group(2)), int(m.group(3))
            if name not in self.task.tools:
                self.tool_errors += 1
                reply = not_found(name, self.task.tools)
            elif name == "mod" and b == 0:
                reply = "error: mod by zero"
            else:
                reply = str(TOOLS[name](a, b))
        else:
            self.malformed += 1
            reply = MALFORMED
        self.turns.append(("tool", reply))
        self.done = sum(role == "assistant" for role, _ in self.turns) >= self.max_turns
        return reply, self.done

    def reward(self) -> float:
        # Outcome only: the verifier checks the final number; how the model got there is not scored.
        return 1.0 if self.answer == self.task.answer else 0.0


# -----------------------------------------------------------------------------
# Gold transcripts for pretraining: the format, the chaining of results, and (sometimes) an error and its recovery.


def gold_transcript(task: ToolTask, rng: random.Random, p_mistake: float = 0.0) -> list[Turn]:
    absent = [t for t in TOOLS if t not in task.tools]
    slip = rng.randrange(len(task.plan)) if rng.random() < p_mistake else -1
    turns = [("user", task.question)]
    for i, (name, a, b) in enumerate(task.plan):
        if i == slip:  # reach for an absent tool, read the error, then make the right call
            wrong = rng.choice(absent)
            turns += [("assistant", f"call {wrong} {a} {b}"), ("tool", not_found(wrong, task.tools))]
        turns += [("assistant", f"call {name} {a} {b}"), ("tool", str(TOOLS[name](a, b)))]
    return turns + [("assistant", f"answer {task.answer}")]


def corpus(n: int, seed: int, p_mistake: float = 0.2) -> str:
    rng = random.Random(seed)
    tasks = (make_tool_task(rng, rng.randint(1, MAX_DIFFICULTY)) for _ in range(n))
    return "\n".join(render(gold_transcript(t, rng, p_mistake)) for t in tasks)


# -----------------------------------------------------------------------------
# Dynamic difficulty: serve the hardest level the policy passes often enough, step back when it fails.


class DifficultySampler:
    def __init__(self, max_level: int = MAX_DIFFICULTY, window: int = 32, up: float = 0.8, down: float = 0.2,
                 p_frontier: float = 0.75):
        self.max_level, self.window, self.up, self.down, self.p_frontier = max_level, window, up, down, p_frontier
        self.level = 1  # the frontier
        self.results = {lvl: deque(maxlen=window) for lvl in range(1, max_level + 1)}  # recent rewards per level

    def pass_rate(self, level: int) -> Optional[float]:
        r = self.results[level]
        return sum(r) / len(r) if r else None

    def sample(self, rng: random.Random) -> int:
        # Mostly the frontier; sometimes an easier level, so solved skills keep being rehearsed.
        if self.level == 1 or rng.random() < self.p_frontier:
            return self.level
        return rng.randint(1, self.level - 1)

    def update(self, level: int, reward: float) -> None:
        self.results[level].append(reward)
        r = self.results[self.level]
        if len(r) < self.window:
            return  # judge a level only on a full window
        rate = sum(r) / len(r)
        if rate >= self.up and self.level < self.max_level:
            self._move(self.level + 1)
        elif rate < self.down and self.level > 1:
            self._move(self.level - 1)

    def _move(self, level: int) -> None:
        self.level = level
        self.results[level].clear()  # the new frontier earns its next move on fresh results, so no instant bounce

    def state_dict(self) -> dict:
        return {"level": self.level, "results": {str(k): list(v) for k, v in self.results.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.level = int(state["level"])
        for k, v in state["results"].items():
            self.results[int(k)] = deque(v, maxlen=self.window)


# -----------------------------------------------------------------------------
# Demo


def main():
    parser = argparse.ArgumentParser(description="Show the tool-use task family: tasks, gold transcripts, an episode.")
    parser.add_argument("--seed", type=int, default=0, help="random seed for every sample below")
    parser.add_argument("--per-level", type=int, default=2, help="tasks shown per difficulty level (1..4)")
    parser.add_argument("--p-mistake", type=float, default=0.5, help="chance a gold transcript shows an error and recovery")
    args = parser.parse_args()
    if args.per_level < 1:
        sys.exit(f"error: --per-level must be >= 1, got {args.per_level}")
    if not 0.0 <= args.p_mistake <= 1.0:
        sys.exit(f"error: --p-mistake must be in [0, 1], got {args.p_mistake}")
    rng = random.Random(args.seed)

    for level in range(1, MAX_DIFFICULTY + 1):
        print(f"--- difficulty {level}")
        for _ in range(args.per_level):
            task = make_tool_task(rng, level)
            text = render(gold_transcript(task, rng, args.p_mistake))
            n_tokens = len(re.sub(r"<\|\w+\|>", "x", text).encode())  # each special string is one token
            print(f"{task.question}  -> {task.answer}   plan {task.plan}\n  {text}  ({len(text.encode())} bytes, {n_tokens} tokens)")

    print("--- one ToolEnv episode, scripted policy: an absent tool, a malformed message, then the gold plan")
    task = make_tool_task(rng, 2)
    env = ToolEnv(task)
    absent = next(t for t in TOOLS if t not in task.tools)
    name, a, b = task.plan[0]
    script = [f"call {absent} {a} {b}", "compute it please"] + [f"call {n} {x} {y}" for n, x, y in task.plan]
    for text in script + [f"answer {task.answer}"]:
        reply, done = env.step(text)
        if done:
            break
    for role, text in env.turns:
        print(f"  {role:>9}: {text}")
    print(f"  reward {env.reward()}, tool_calls {env.tool_calls}, tool_errors {env.tool_errors}, malformed {env.malformed}")

    print("--- DifficultySampler against a simulated policy that passes levels 1..4 with p = 0.95, 0.9, 0.5, 0.1")
    sampler, skill = DifficultySampler(), {1: 0.95, 2: 0.9, 3: 0.5, 4: 0.1}
    for i in range(1, 601):
        level = sampler.sample(rng)
        sampler.update(level, float(rng.random() < skill[level]))
        if i % 100 == 0:
            rates = {k: None if v is None else round(v, 2) for k in skill for v in [sampler.pass_rate(k)]}
            print(f"  episode {i}: frontier {sampler.level}, pass rates {rates}")


if __name__ == "__main__":
    main()
