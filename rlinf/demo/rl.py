"""The learning part of the demo, free of any messaging: policy, rollouts, REINFORCE.

Kept separate so the algorithm can be read (and tested) on its own. Rollout workers
call :class:`EnvRunner` to play CartPole with the latest weights; learners call
:func:`reinforce_gradients` on the trajectories they took from the channel.
"""

from __future__ import annotations

import math
import numpy as np
import torch

__all__ = ["make_policy", "EnvRunner", "reinforce_gradients", "flat_grads", "set_flat_grads",
           "returns_to_go"]

ENV_ID = "CartPole-v1"


def make_policy(obs_dim: int = 4, n_actions: int = 2, hidden: int = 32, seed: int = 0) -> torch.nn.Module:
    """A small MLP mapping observations to action logits."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(obs_dim, hidden), torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
        torch.nn.Linear(hidden, n_actions),
    )


def returns_to_go(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """Discounted reward-to-go of one episode."""
    out = np.empty(len(rewards), dtype=np.float32)
    running = 0.0
    for i in range(len(rewards) - 1, -1, -1):
        running = rewards[i] + gamma * running
        out[i] = running
    return out


class EnvRunner:
    """Plays ``n`` CartPole environments in lock-step with one batched policy forward.

    ``episodes()`` yields finished trajectories, each a dict of tensors:
    ``obs`` (T, 4) float32, ``actions`` (T,) int64, ``rewards`` (T,) float32,
    ``returns`` (T,) float32 (discounted reward-to-go) plus ``length`` and ``ret``.
    """

    def __init__(self, n: int, seed: int, gamma: float) -> None:
        import gymnasium as gym

        self.envs = [gym.make(ENV_ID) for _ in range(n)]
        self.gamma = gamma
        self.rng = torch.Generator().manual_seed(seed)
        self.obs = [env.reset(seed=seed * 1000 + i)[0] for i, env in enumerate(self.envs)]
        self.buffers: list[tuple[list, list, list]] = [([], [], []) for _ in self.envs]
        self.steps = 0

    def close(self) -> None:
        for env in self.envs:
            env.close()

    @torch.no_grad()
    def run(self, policy: torch.nn.Module, min_steps: int) -> list[dict]:
        """Step every environment until ``min_steps`` steps were taken and at least one
        episode finished; return the finished episodes."""
        done_eps: list[dict] = []
        taken = 0
        while taken < min_steps or not done_eps:
            obs = torch.from_numpy(np.stack(self.obs).astype(np.float32))
            probs = torch.softmax(policy(obs), dim=-1)
            actions = torch.multinomial(probs, 1, generator=self.rng).squeeze(1).numpy()
            for i, env in enumerate(self.envs):
                o, r, a = self.buffers[i]
                o.append(self.obs[i])
                a.append(int(actions[i]))
                nxt, reward, terminated, truncated, _ = env.step(int(actions[i]))
                r.append(reward)
                if terminated or truncated:
                    done_eps.append(self._finish(i))
                    nxt, _ = env.reset()
                self.obs[i] = nxt
            taken += len(self.envs)
        self.steps += taken
        return done_eps

    def _finish(self, i: int) -> dict:
        o, r, a = self.buffers[i]
        rewards = np.asarray(r, dtype=np.float32)
        episode = {
            "obs": torch.from_numpy(np.asarray(o, dtype=np.float32)),
            "actions": torch.tensor(a, dtype=torch.int64),
            "rewards": torch.from_numpy(rewards),
            "returns": torch.from_numpy(returns_to_go(rewards, self.gamma)),
            "length": len(r),
            "ret": float(rewards.sum()),
        }
        self.buffers[i] = ([], [], [])
        return episode


def reinforce_gradients(policy: torch.nn.Module, episodes: list[dict], mean: float, std: float) -> float:
    """Accumulate into ``policy``'s ``.grad`` the *sum* over all steps of the REINFORCE
    loss gradient, with returns standardised by the global ``mean``/``std`` (a baseline
    shared by every learner). Returns the summed loss."""
    if not episodes:
        return 0.0
    obs = torch.cat([e["obs"] for e in episodes])
    actions = torch.cat([e["actions"] for e in episodes])
    returns = torch.cat([e["returns"] for e in episodes])
    adv = (returns - mean) / (std + 1e-8)
    logp = torch.log_softmax(policy(obs), dim=-1).gather(1, actions.unsqueeze(1)).squeeze(1)
    loss = -(logp * adv).sum()
    loss.backward()
    return float(loss.detach())


def flat_grads(policy: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient in one flat tensor (zeros where there is none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in policy.parameters()])


def set_flat_grads(policy: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in policy.parameters():
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def return_stats(episodes: list[dict]) -> np.ndarray:
    """``[sum, sum of squares, count]`` of the per-step returns (for a global baseline)."""
    if not episodes:
        return np.zeros(3, dtype=np.float64)
    returns = torch.cat([e["returns"] for e in episodes]).double()
    return np.array([float(returns.sum()), float((returns * returns).sum()), float(returns.numel())])


def mean_std(stats: np.ndarray) -> tuple[float, float]:
    total, squares, n = (float(x) for x in stats)
    if n <= 0:
        return 0.0, 1.0
    mean = total / n
    return mean, math.sqrt(max(squares / n - mean * mean, 0.0))
