//! `execute --profile`: one rank's wall time per kind of node (the executor synchronizes
//! the backend after each node, so a node's time is its own work, host and device), over
//! the steps after the first (that one pays for first-use set-up: GEMM plans, tables). A
//! table on stderr at the end of the run, the largest first, with the time between nodes
//! (hooks, checksums, the step's bookkeeping) as its own row.

use std::collections::BTreeMap;
use std::fmt::Write;

/// Per kind: node count and seconds, summed over steps.
type Times = BTreeMap<String, (u64, f64)>;

#[derive(Default)]
pub struct Profile {
    /// The first step's nodes and wall seconds (used when it is the only step).
    first: Option<(Times, f64)>,
    /// The later steps': summed.
    rest: Times,
    rest_s: f64,
    rest_steps: u32,
}

impl Profile {
    /// One step's report of the profiled rank: its nodes' times and the step's seconds.
    pub fn add(&mut self, nodes: &Times, seconds: f64) {
        if self.first.is_none() {
            self.first = Some((nodes.clone(), seconds));
            return;
        }
        for (k, &(n, s)) in nodes {
            let e = self.rest.entry(k.clone()).or_default();
            e.0 += n;
            e.1 += s;
        }
        self.rest_s += seconds;
        self.rest_steps += 1;
    }

    /// The table: milliseconds per step, share of the step, nodes per step, kind.
    pub fn table(&self, rank: u32) -> String {
        let (times, step_s, steps, which) = if self.rest_steps > 0 {
            (
                &self.rest,
                self.rest_s,
                self.rest_steps,
                "steps after the first",
            )
        } else {
            match &self.first {
                Some((t, s)) => (t, *s, 1, "the only step"),
                None => return "profile: no step finished\n".into(),
            }
        };
        let per = |x: f64| x / steps as f64;
        let mut rows: Vec<(&String, u64, f64)> =
            times.iter().map(|(k, &(n, s))| (k, n, s)).collect();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2).then_with(|| a.0.cmp(b.0)));
        let nodes_s: f64 = rows.iter().map(|r| r.2).sum();
        let share = |s: f64| 100.0 * s / step_s.max(1e-12);
        let mut out = format!(
            "profile of rank {rank}, mean of {steps} step(s) ({which}): {:.1} ms per step\n{:>12} {:>7} {:>8}  node kind\n",
            1e3 * per(step_s),
            "ms/step",
            "share",
            "nodes"
        );
        for (k, n, s) in &rows {
            let _ = writeln!(
                out,
                "{:>12.3} {:>6.1}% {:>8}  {k}",
                1e3 * per(*s),
                share(*s),
                n / steps as u64
            );
        }
        let between = (step_s - nodes_s).max(0.0);
        let _ = writeln!(
            out,
            "{:>12.3} {:>6.1}% {:>8}  (between nodes: hooks, checks, bookkeeping)",
            1e3 * per(between),
            share(between),
            ""
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn times(rows: &[(&str, u64, f64)]) -> Times {
        rows.iter()
            .map(|&(k, n, s)| (k.to_string(), (n, s)))
            .collect()
    }

    /// Hand-worked: the first step is left out, the later two averaged; rows by time,
    /// ties by name; the time outside nodes is the step's minus the nodes'.
    #[test]
    fn later_steps_averaged_largest_first() {
        let mut p = Profile::default();
        p.add(&times(&[("fwd gemm qkv", 2, 9.0)]), 10.0);
        p.add(
            &times(&[("fwd gemm qkv", 2, 0.010), ("bwd attention", 1, 0.030)]),
            0.050,
        );
        p.add(
            &times(&[("fwd gemm qkv", 2, 0.014), ("bwd attention", 1, 0.030)]),
            0.050,
        );
        let t = p.table(0);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].contains("mean of 2 step(s)") && lines[0].contains("50.0 ms"),
            "{t}"
        );
        assert!(
            lines[2].ends_with("bwd attention") && lines[2].contains("30.000"),
            "{t}"
        );
        assert!(lines[2].contains("60.0%"), "{t}");
        assert!(
            lines[3].ends_with("fwd gemm qkv") && lines[3].contains("12.000"),
            "{t}"
        );
        assert!(lines[3].contains(" 2  "), "{t}");
        // 50 - 30 - 12 = 8 ms between nodes.
        assert!(
            lines[4].contains("8.000") && lines[4].contains("between nodes"),
            "{t}"
        );
    }

    #[test]
    fn a_single_step_is_reported_as_such() {
        let mut p = Profile::default();
        assert!(p.table(0).contains("no step finished"));
        p.add(&times(&[("step optimizer_step", 1, 0.5)]), 1.0);
        let t = p.table(3);
        assert!(
            t.contains("rank 3") && t.contains("the only step") && t.contains("500.000"),
            "{t}"
        );
    }
}
