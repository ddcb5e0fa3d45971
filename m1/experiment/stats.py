"""The numbers of `m1 experiment report`, computed before any is formatted (report.py only formats them): accuracy per
arm (mean +- sd over seeds, overall and per question family), paired differences against the baseline arm (the
first, unless `baseline:` names another) with the answers each arm changed against it, the plans the agents chose,
their replies' strict format and the seed-kind teams' behaviour.

Every number is read from the eval stages' compact rows (`compact_eval`: per graded question its family, the team's
answer, whether it is right, and each agent's first plan): made from the stage's results file when its run folder is
here, else read from the committed rows the runner wrote under `rows_dir`, so a report needs no out_dir; a question's
family is its `meta.family` in the questions file, else its `task`. The paired difference of an arm is taken seed by
seed against the baseline arm (the same seed's SFT data order, rollouts and sampling), so seed-to-seed spread common
to both arms cancels; its 95% interval is mean +- t(0.975, n-1) * sd / sqrt(n), and with one seed there is none. Per
seed, the questions an arm answers right and the baseline wrong ("fixed") or the reverse ("broken") get an exact
two-sided sign test: a gain made of few fixes and no breaks is learning, many changes both ways a perturbation.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from m1.experiment.config import Experiment, ExperimentError
from m1.experiment.records import read_record, stage_identity
from m1.experiment.rows import compact_eval, read_results, tools
from m1.experiment.stages import StageRun, eval_questions, read_stage, torn_results

ALL = "all"


# ------------------------------------------------------------------------------------------------ statistics
def t_quantile_975(df: int) -> float:
    """t(0.975, df): 12.706 at df 1, 4.303 at df 2, -> 1.960."""
    from scipy.stats import t

    if df < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    return float(t.ppf(0.975, df))


def sign_test_p(fixed: int, broken: int) -> float:
    """Exact two-sided sign (McNemar) test on the questions that changed from wrong to right or back: the chance of
    a split at least this uneven if each were a fair coin (1 when none changed)."""
    from scipy.stats import binomtest

    n = fixed + broken
    return float(binomtest(min(fixed, broken), n, 0.5).pvalue) if n else 1.0


def mean_sd(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (nan with fewer than two values)."""
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else float("nan")
    return m, sd


def paired(diffs: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) of the 95% t interval of paired differences; low/high nan for one pair."""
    m, sd = mean_sd(diffs)
    if len(diffs) < 2:
        return m, float("nan"), float("nan")
    half = t_quantile_975(len(diffs) - 1) * sd / math.sqrt(len(diffs))
    return m, m - half, m + half


# ------------------------------------------------------------------------------------------------ reading results
@dataclass
class ArmResult:
    """Per seed, per family (and "all"): (correct, graded) of one arm's eval results."""

    arm: str
    counts: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)  # seeds whose eval stage has not finished
    answers: dict[int, dict[str, tuple[Any, bool]]] = field(default_factory=dict)  # seed -> id -> (answer, correct)
    # seed -> id -> agent (its place in the row) -> (first plan, written in the strict format, its own answer right)
    plans: dict[int, dict[str, dict[int, tuple[tuple[str, ...], bool, bool]]]] = field(default_factory=dict)
    family_of: dict[str, str] = field(default_factory=dict)  # question id -> family
    formats: dict[str, list[int]] = field(default_factory=dict)  # phase -> [strict, generations], from traces
    shared: dict[int, int] = field(default_factory=dict)  # seed -> the seed whose eval it is (sft_share)
    notes: list[str] = field(default_factory=list)  # why rows were left out
    # seed -> id -> {frames, calls[, zooms]}: how a seed-kind team answered (`rows.behaviour`)
    behaviour: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def accuracy(self, seed: int, family: str) -> float | None:
        c, n = self.counts[seed].get(family, (0, 0))
        return c / n if n else None


def eval_rows(exp: Experiment, arm: str, seed: int, questions: list) -> tuple[dict[str, Any] | None, str | None]:
    """The compact rows of an arm's eval at a seed and a note: from its run folder when finished here
    (`questions`: a list the eval questions are read into once), else its committed record and rows under rows_dir
    when made with this config (else None, and why)."""
    folder = exp.stage_dir(arm, seed, "eval")
    record = read_stage(folder)
    if record is not None:
        torn = torn_results(folder, record)
        if torn is not None:  # never a silently short row set
            raise ExperimentError(f"arm {arm} seed {seed}: {torn}; rerun `m1 experiment run` to repair it, then "
                                  "the report")
        if not questions:
            questions += eval_questions(exp)[0]
        return compact_eval(record, folder, questions, exp.eval.source if exp.eval else "-"), None
    run = StageRun(exp.owner(arm, "eval"), exp.stage_seed(arm, seed, "eval"), "eval", folder)
    record = read_record(exp, run)
    if record is None:
        return None, None
    ident = stage_identity(exp, run.arm, run.seed, "eval")
    path = exp.record_path(arm, seed, "eval")
    if record.get("identity") != ident:
        return None, (f"arm {arm} seed {seed}: {path} was recorded with another config (identity "
                      f"{record.get('identity')}, now {ident}; left out: rerun `m1 experiment run`)")
    return {**record, "rows": read_results(path.with_suffix(".jsonl"))}, None


def collect(exp: Experiment) -> tuple[list[ArmResult], list[str]]:
    """Read every finished eval stage (`eval_rows`). Returns the arms' counts and the families in order (all
    first)."""
    if exp.eval is None:
        raise ExperimentError(f"experiment {exp.name}: no eval stage, nothing to report")
    families: list[str] = []
    questions: list = []
    out = []
    for arm in exp.arms:
        res = ArmResult(arm)
        for seed in exp.seeds:
            compact, note = eval_rows(exp, arm, seed, questions)
            if compact is None:
                res.missing.append(seed)
                res.notes += [note] if note else []
                continue
            families += [f for f in compact["families"] if f not in families]
            head = exp.stage_seed(arm, seed, "eval")
            if head != seed:
                res.shared[seed] = head
            counts: dict[str, list[int]] = {ALL: [0, 0]}
            answers = res.answers.setdefault(seed, {})
            plans = res.plans.setdefault(seed, {})
            for row in compact["rows"]:
                answers[row["id"]] = (row["answer"], row["correct"])
                plans[row["id"]] = {i: (tools(p), bool(ok), bool(right))
                                    for i, (p, ok, right) in enumerate(row["agents"])}
                res.family_of[row["id"]] = fam = row["family"]
                if "frames" in row:
                    res.behaviour.setdefault(seed, {})[row["id"]] = {k: row[k] for k in ("frames", "calls", "zooms")
                                                                     if k in row}
                for key in (ALL, fam):
                    c = counts.setdefault(key, [0, 0])
                    c[0] += row["correct"]
                    c[1] += 1
            res.counts[seed] = {k: (v[0], v[1]) for k, v in counts.items()}
            if head == seed:
                for phase, (ok, n) in compact.get("formats", {}).items():
                    c = res.formats.setdefault(phase, [0, 0])
                    c[0] += ok
                    c[1] += n
        out.append(res)
    return out, [ALL] + families


# ------------------------------------------------------------------------------------------------ the tables
def answer_changes(arms: list[ArmResult], base: str) -> list[dict[str, Any]]:
    """Per arm and seed, its graded answers against the baseline's of the same seed, on the questions both graded:
    how many changed, wrong -> right ("fixed"), right -> wrong ("broken"), and the sign test's p."""
    ref = next(a for a in arms if a.arm == base)
    out = []
    for res in arms:
        if res is ref:
            continue
        for seed in sorted(res.answers):
            if seed not in ref.answers:
                continue
            mine, theirs = res.answers[seed], ref.answers[seed]
            ids = [i for i in mine if i in theirs]
            fixed = sum(mine[i][1] and not theirs[i][1] for i in ids)
            broken = sum(theirs[i][1] and not mine[i][1] for i in ids)
            out.append({"arm": res.arm, "seed": seed, "n": len(ids),
                        "changed": sum(mine[i][0] != theirs[i][0] for i in ids), "fixed": fixed, "broken": broken,
                        "p": sign_test_p(fixed, broken)})
    return out


def plan_choices(arms: list[ArmResult], families: list[str], family_of: dict[str, str], min_uses: int = 20,
                 references: frozenset[str] = frozenset()) -> dict[str, Any]:
    """What the agents planned (results rows' first plans, every seed pooled). A plan's success rate in a family: how
    often the agents that wrote it in the strict format answered right (a plan the parser filled in, such as an
    untrained agent's, was nobody's choice), pooled over the student arms (not `references`, teams such as the
    rule-based teacher whose better reading would credit its own plans; over every arm if all are references).
    Per family the best plan: the highest success rate with at least `min_uses` uses (so one lucky question does not
    decide it). Per arm and family: the share of plans that are the best plan, the most chosen plan and its share,
    `value` (the mean success rate of its strict plans: what the plan choice alone is worth), and every plan's share
    (`shares`); per arm, the share of plans in the strict format. Empty without plans."""
    raters = {res.arm for res in arms if res.arm not in references} or {res.arm for res in arms}
    uses, per_arm, strict = _tally_plans(arms, family_of, raters)
    if not per_arm:
        return {}
    best = {}
    for fam in families:
        if fam == ALL:
            continue
        pool = {p: c for p, c in uses.get(fam, {}).items() if c[1] >= min_uses}
        if pool:
            plan, (right, n) = max(pool.items(), key=lambda kv: (kv[1][0] / kv[1][1], kv[1][1]))
            best[fam] = (plan, right / n, n)
    table = {arm: _arm_plans(fams, uses, best, min_uses) for arm, fams in per_arm.items()}
    rates = {fam: {p: (r / n, n) for p, (r, n) in by.items()} for fam, by in uses.items()}
    return {"best": best, "arms": table, "strict": {a: ok / n for a, (ok, n) in strict.items()}, "rates": rates}


def _tally_plans(arms: list[ArmResult], family_of: dict[str, str], raters: set[str]) -> tuple[
        dict[str, dict[tuple[str, ...], list[int]]], dict[str, dict[str, list]], dict[str, list[int]]]:
    """(uses, chosen, strict): per family (and "all") and plan, [answered right, uses] of the `raters`' strict plans;
    per arm and family, every (plan, strict) its agents wrote; per arm, [strict, plans]. Questions without a family
    are left out."""
    uses: dict[str, dict[tuple[str, ...], list[int]]] = {}
    per_arm: dict[str, dict[str, list]] = {}
    strict: dict[str, list[int]] = {}
    for res in arms:
        rates = res.arm in raters
        for by_id in res.plans.values():
            for qid, agents in by_id.items():
                fam = family_of.get(qid)
                if fam is None:
                    continue
                for plan, ok, right in agents.values():
                    for key in (fam, ALL):
                        if rates and ok:  # a plan the parser repaired or filled in was not chosen
                            u = uses.setdefault(key, {}).setdefault(plan, [0, 0])
                            u[0] += right
                            u[1] += 1
                        per_arm.setdefault(res.arm, {}).setdefault(key, []).append((plan, ok))
                    st = strict.setdefault(res.arm, [0, 0])
                    st[0] += ok
                    st[1] += 1
    return uses, per_arm, strict


def _arm_plans(fams: dict[str, list], uses: dict[str, dict[tuple[str, ...], list[int]]],
               best: dict[str, tuple], min_uses: int) -> dict[str, dict[str, Any]]:
    """One arm's row of `plan_choices` from the (plan, strict) pairs it wrote per family. Over all families, a plan is
    worth its success rate in the family it was chosen for, and is "best" when it is its own family's best plan."""
    table = {}
    for fam, chosen in fams.items():
        plans = [p for p, _ in chosen]
        counts = Counter(plans)
        top, count = counts.most_common(1)[0]
        strict_counts = Counter(p for p, ok in chosen if ok)  # the value of choices, not of the parser's repairs
        rated = [(c, uses[fam][p]) for p, c in strict_counts.items()
                 if uses.get(fam, {}).get(p, [0, 0])[1] >= min_uses]
        table[fam] = {
            "best_share": (counts[best[fam][0]] / len(plans)) if fam in best else None,
            "top": top, "top_share": count / len(plans), "n": len(plans),
            "value": (sum(c * r / n for c, (r, n) in rated) / sum(c for c, _ in rated)) if rated else None,
            "shares": {p: c / len(plans) for p, c in counts.most_common()}, "rated": sum(c for c, _ in rated)}
    parts = [c for fam, c in table.items() if fam != ALL and c["value"] is not None]
    if ALL in table:
        total = sum(c["rated"] for c in parts)
        table[ALL]["value"] = sum(c["value"] * c["rated"] for c in parts) / total if total else None
        table[ALL]["rated"] = total
        with_best = [c for fam, c in table.items() if fam != ALL and c["best_share"] is not None]
        n = sum(c["n"] for c in with_best)
        table[ALL]["best_share"] = sum(c["best_share"] * c["n"] for c in with_best) / n if n else None
    return table


def strict_format(arms: list[ArmResult]) -> dict[str, dict[str, float]]:
    """Per arm that traced its eval (`eval.traces`), per phase: the share of its agents' replies that parsed in the
    strict format, over every traced question of every seed (training teaches format before it teaches answers).
    Arms without traces are left out."""
    return {res.arm: {phase: ok / n for phase, (ok, n) in res.formats.items() if n} for res in arms if res.formats}


BEHAVIOUR = ("frames", "calls", "no_tool", "zoom_s", "zoom_fps")


def _mean(xs: list) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _behaviour_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per question: frames seen, tool calls, the share answered without a call; over every zoom: its length (s) and
    fps. None where nothing was measured (never a zero that was not observed)."""
    calls = [r["calls"] for r in rows if r.get("calls") is not None]
    zooms = [z for r in rows for z in r.get("zooms", [])]
    return {"questions": len(rows), "frames": _mean([r["frames"] for r in rows if r.get("frames") is not None]),
            "calls": _mean(calls), "no_tool": _mean([c == 0 for c in calls]),
            "zoom_s": _mean([z[0] for z in zooms]), "zoom_fps": _mean([z[1] for z in zooms])}


def behaviour_table(arms: list[ArmResult], families: list[str]) -> list[dict[str, Any]]:
    """How the seed-kind arms (Weaver, VideoZoomer, SAGE: those whose rows carry `frames`) behave, as their papers
    measure it (`_behaviour_of`): per arm, family and seed, then the arm's mean over its seeds (seed "mean"; a seed
    sharing another's eval counted once). A seed whose rows carry none of it (a record written before they did)
    has questions 0 and every value None. Empty when no arm's rows carry `frames`."""
    out = []
    for res in arms:
        if not any(res.behaviour.values()):
            continue
        seeds = [s for s in sorted(res.counts) if s not in res.shared]
        for fam in families:
            per = [{"arm": res.arm, "family": fam, "seed": s, **_behaviour_of(
                [b for q, b in res.behaviour.get(s, {}).items() if fam in (ALL, res.family_of.get(q))])}
                for s in seeds]
            mean = {k: _mean([r[k] for r in per if r[k] is not None]) for k in BEHAVIOUR}
            out += per + [{"arm": res.arm, "family": fam, "seed": "mean",
                           "questions": sum(r["questions"] for r in per), **mean}]
    return out



def shared_note(exp: Experiment) -> str | None:
    """The report's line on SFT runs shared by several seeds (`sft_share`), None where each seed has its own."""
    if exp.sft is None or exp.sft_share == 1:
        return None
    groups: dict[int, list[int]] = {}
    for seed in exp.seeds:
        groups.setdefault(seed - seed % exp.sft_share, []).append(seed)

    def span(g: list[int]) -> str:
        return f"{g[0]}-{g[-1]}" if len(g) > 2 and g == list(range(g[0], g[-1] + 1)) else ", ".join(map(str, g))

    only = [a for a in exp.arms if exp.arm_stages(a)[:-1] == ["sft"] and exp.arm_stages(a)[-1] == "eval"]
    line = (f"SFT shared by seeds {' / '.join(span(g) for g in groups.values())} (sft_share {exp.sft_share}): every "
            "MARL seed starts from its group's SFT weights, with its own rollouts and data order")
    if only:
        line += (f"; arms that train only SFT ({', '.join(only)}) are answered once per group: their mean ± sd and "
                 f"per-seed rows are over seeds {', '.join(map(str, groups))}, their rows reused seed by seed for the "
                 "paired differences and answer changes against an arm with a run per seed (against one another: "
                 "once per group)")
    return line


def summarize(exp: Experiment, collected: tuple[list[ArmResult], list[str]] | None = None
              ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """One row per arm x family: per-seed accuracies, mean, sd, and the paired difference to the baseline arm (per
    seed, mean, standard error sd/sqrt(n) and 95% interval). Also returns the families and notes (missing seeds,
    shared SFT). `collected`: `collect(exp)`'s result, if already read. A seed that reuses another's eval
    (`ArmResult.shared`) counts once in the mean and sd, and seed by seed in the paired differences, but for a seed
    whose baseline eval is reused as well: that pair is its group's first pair again, and counting it twice would
    narrow the interval with no new evidence."""
    arms, families = collected or collect(exp)
    base = next(a for a in arms if a.arm == exp.base_arm)
    rows, notes = [], []
    for res in arms:
        if res.missing:
            notes.append(f"arm {res.arm}: eval not finished for seeds {res.missing} (left out)")
        notes += res.notes
        for fam in families:
            every = {s: res.accuracy(s, fam) for s in res.counts}
            every = {s: a for s, a in every.items() if a is not None}
            per_seed = {s: a for s, a in every.items() if s not in res.shared}
            row: dict[str, Any] = {"arm": res.arm, "family": fam, "seeds": sorted(per_seed),
                                   "accuracy": [per_seed[s] for s in sorted(per_seed)],
                                   "graded": sum(res.counts[s].get(fam, (0, 0))[1] for s in per_seed)}
            row["mean"], row["sd"] = mean_sd(row["accuracy"]) if per_seed else (float("nan"), float("nan"))
            if res is not base:
                both = [s for s in sorted(every) if s in base.counts and base.accuracy(s, fam) is not None
                        and not (s in res.shared and s in base.shared)]
                diffs = [every[s] - base.accuracy(s, fam) for s in both]  # type: ignore[operator]
                row["diff_seeds"], row["diff"] = both, diffs
                row["diff_mean"], row["diff_low"], row["diff_high"] = (
                    paired(diffs) if diffs else (float("nan"),) * 3)
                row["diff_se"] = mean_sd(diffs)[1] / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
            rows.append(row)
    note = shared_note(exp)
    return rows, families, notes + ([note] if note else [])



@dataclass
class ReportStats:
    """Every number of the report, by table: `rows` and `families` (`summarize`), the notes under it, the answers each
    arm changed against the baseline (`answer_changes`), the strict-format shares (`strict_format`), the plans chosen
    (`plan_choices`) and the seed-kind teams' behaviour (`behaviour_table`); empty where the rows carry none."""

    rows: list[dict[str, Any]]
    families: list[str]
    notes: list[str]
    changes: list[dict[str, Any]] = field(default_factory=list)
    formats: dict[str, dict[str, float]] = field(default_factory=dict)
    plans: dict[str, Any] = field(default_factory=dict)
    behaviour: list[dict[str, Any]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """No arm has a finished eval at any seed: nothing to report."""
        return all(not r["seeds"] for r in self.rows)


def report_stats(exp: Experiment) -> ReportStats:
    """Read every finished eval (`collect`) and compute each table's numbers; the plans are rated over the student
    arms, not the arms answered by a reference team of their own (`eval_team`)."""
    collected = collect(exp)
    arms = collected[0]
    rows, families, notes = summarize(exp, collected)
    references = frozenset(a for a, spec in exp.arms.items() if spec.eval_team is not None)
    family_of = {q: f for res in arms for q, f in res.family_of.items()}
    return ReportStats(rows, families, notes, changes=answer_changes(arms, exp.base_arm),
                       formats=strict_format(arms),
                       plans=plan_choices(arms, families, family_of, references=references),
                       behaviour=behaviour_table(arms, families))
