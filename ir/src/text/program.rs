//! Canonical text form of a whole [`Program`]: what `shardwright lower PLAN -o prog.ir`
//! writes and `shardwright execute prog.ir` runs.
//!
//! ```text
//! file    := header program model [moe] run group* rank* class*
//! header  := '; shardwright-program 1'
//! program := 'program' 'world=' U32
//! model   := 'model' 'layers=' U32 'hidden=' U64 'heads=' U32 'kv_heads=' U32
//!            'head_dim=' U32 'ffn=' U64 'vocab=' U64 'seq=' U64 'norm=' NORM
//!            'activation=' ACT ['learned_positions'] ['tied_embeddings'] ['linear_bias']
//!            ['dropout'] ['causal'] ['sliding_window=' U64] 'sink_tokens=' U64
//! moe     := 'moe' 'experts=' U32 'top_k=' U32 'expert_ffn=' U64 'shared_ffn=' U64
//!            'first_k_dense=' U32
//! run     := 'run' 'tp=' U32 'cp=' U32 'ep=' U32 'dp=' U32 'pp=' U32 'micro_batch=' U32
//!            'grad_accum=' U64 'global_batch=' U64 'zero=' U8 'model_flops=' U64
//!            ['sequence_parallel'] ['op_level_recompute'] ['whole_experts']
//! group   := as in a graph (every group of the program)
//! rank    := 'rank' U32 'class=' U32 'groups=' [GROUPID (',' GROUPID)*]
//!            ['coord=' U32 ',' U32 ',' U32 ',' U32 ',' U32]   (tp, cp, ep, dp, pp)
//! class   := 'class' U32 'ranks=' [U32 (',' U32)*]  followed by the class's graph in the
//!            graph text form ([`super::print`]), up to the next `class` line
//! ```
//!
//! `model`, `moe` and `run` are absent for a program built by hand (no model to train);
//! `rank` lines come in rank order, `class` lines in class order. [`parse_program`] inverts
//! [`print_program`] exactly; errors carry the line number in the whole file.

use super::{parse_group, parse_int, write_group, write_list, Cursor, ParseError};
use crate::ids::GroupId;
use crate::program::{Program, RankClass};
use crate::run::{Activation, ModelInfo, MoeInfo, NormKind, RunInfo};
use crate::vocab::Coord;
use std::fmt::Write as _;

/// The first line of every printed program.
pub const PROGRAM_HEADER: &str = "; shardwright-program 1";

/// The whole program, ending with a newline.
pub fn print_program(p: &Program) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{PROGRAM_HEADER}");
    let _ = writeln!(out, "program world={}", p.world);
    if let Some(m) = &p.model {
        write_model(&mut out, m);
    }
    if let Some(r) = &p.run {
        write_run(&mut out, r);
    }
    for g in &p.groups {
        write_group(&mut out, g);
    }
    let ranks = p.class_of.len().max(p.membership.len());
    for r in 0..ranks {
        let class = p.class_of.get(r).copied().unwrap_or(u32::MAX);
        let _ = write!(out, "rank {r} class={class} groups=");
        write_list(&mut out, p.membership.get(r).map_or(&[][..], |v| v));
        if let Some(c) = p.coords.get(r) {
            out.push_str(" coord=");
            write_list(&mut out, &c.as_array());
        }
        out.push('\n');
    }
    for (i, c) in p.classes.iter().enumerate() {
        let _ = write!(out, "class {i} ranks=");
        write_list(&mut out, &c.ranks);
        out.push('\n');
        out.push_str(&super::print(&c.graph));
    }
    out
}

fn write_model(out: &mut String, m: &ModelInfo) {
    let _ = write!(
        out,
        "model layers={} hidden={} heads={} kv_heads={} head_dim={} ffn={} vocab={} seq={} \
         norm={} activation={}",
        m.layers,
        m.hidden,
        m.heads,
        m.kv_heads,
        m.head_dim,
        m.ffn,
        m.vocab,
        m.seq,
        m.norm.name(),
        m.activation.name()
    );
    for (on, flag) in [
        (m.learned_positions, "learned_positions"),
        (m.tied_embeddings, "tied_embeddings"),
        (m.linear_bias, "linear_bias"),
        (m.dropout, "dropout"),
        (m.causal, "causal"),
    ] {
        if on {
            let _ = write!(out, " {flag}");
        }
    }
    if let Some(w) = m.sliding_window {
        let _ = write!(out, " sliding_window={w}");
    }
    let _ = writeln!(out, " sink_tokens={}", m.attention_sink_tokens);
    if let Some(e) = &m.moe {
        let _ = writeln!(
            out,
            "moe experts={} top_k={} expert_ffn={} shared_ffn={} first_k_dense={}",
            e.experts, e.top_k, e.expert_ffn, e.shared_ffn, e.first_k_dense
        );
    }
}

fn write_run(out: &mut String, r: &RunInfo) {
    let _ = write!(
        out,
        "run tp={} cp={} ep={} dp={} pp={} micro_batch={} grad_accum={} global_batch={} \
         zero={} model_flops={}",
        r.tp,
        r.cp,
        r.ep,
        r.dp,
        r.pp,
        r.micro_batch,
        r.grad_accum,
        r.global_batch,
        r.zero_stage,
        r.model_flops
    );
    for (on, flag) in [
        (r.sequence_parallel, "sequence_parallel"),
        (r.op_level_recompute, "op_level_recompute"),
        (r.whole_experts, "whole_experts"),
    ] {
        if on {
            let _ = write!(out, " {flag}");
        }
    }
    out.push('\n');
}

/// Parse the text form of a program (see the module doc).
pub fn parse_program(s: &str) -> Result<Program, ParseError> {
    let lines: Vec<&str> = s.split('\n').collect();
    let err = |line: usize, found: &str, expected: &str| ParseError {
        line,
        column: 1,
        found: found.into(),
        expected: expected.into(),
    };
    let mut p = Program::default();
    let mut saw_program = false;
    let mut i = 0;
    // The header part: everything before the first `class` line.
    while i < lines.len() {
        let lineno = i + 1;
        let line = lines[i].strip_suffix('\r').unwrap_or(lines[i]);
        let t = line.trim_start();
        if t.is_empty() {
            i += 1;
            continue;
        }
        if let Some(comment) = t.strip_prefix(';') {
            let mut w = comment.split_whitespace();
            if w.next() == Some("shardwright-program") {
                if let Some(v) = w.next().filter(|v| *v != "1") {
                    return Err(err(lineno, &format!("version `{v}`"), PROGRAM_HEADER));
                }
            }
            i += 1;
            continue;
        }
        let mut c = Cursor::of_line(line, lineno)?;
        let first = c.peek().expect("non-empty line").text;
        if !saw_program {
            c.keyword("program")?;
            p.world = c.u32("world")?;
            c.end()?;
            saw_program = true;
            i += 1;
            continue;
        }
        match first {
            "class" => break,
            "model" => {
                c.pos += 1;
                p.model = Some(parse_model(&mut c)?);
            }
            "moe" => {
                c.pos += 1;
                let m = p
                    .model
                    .as_mut()
                    .ok_or_else(|| err(lineno, "`moe`", "a `model` line before the `moe` line"))?;
                m.moe = Some(MoeInfo {
                    experts: c.u32("experts")?,
                    top_k: c.u32("top_k")?,
                    expert_ffn: c.u64("expert_ffn")?,
                    shared_ffn: c.u64("shared_ffn")?,
                    first_k_dense: c.u32("first_k_dense")?,
                });
            }
            "run" => {
                c.pos += 1;
                p.run = Some(parse_run(&mut c)?);
            }
            "group" => {
                c.pos += 1;
                p.groups.push(parse_group(&mut c)?);
            }
            "rank" => {
                c.pos += 1;
                parse_rank(&mut c, &mut p)?;
            }
            _ => {
                return Err(c.err_at(
                    c.peek(),
                    "`model`, `moe`, `run`, `group`, `rank` or `class`",
                ))
            }
        }
        c.end()?;
        i += 1;
    }
    if !saw_program {
        return Err(err(
            lines.len().max(1),
            "end of input",
            "`program world=<integer>`",
        ));
    }
    // The classes: a `class` line, then its graph up to the next `class` line.
    while i < lines.len() {
        let lineno = i + 1;
        let line = lines[i].strip_suffix('\r').unwrap_or(lines[i]);
        let mut c = Cursor::of_line(line, lineno)?;
        c.keyword("class")?;
        let index: u32 = c.id("the class index")?;
        if index as usize != p.classes.len() {
            return Err(c.err_at(
                c.toks.get(1).copied(),
                format!("class {} (classes come in order)", p.classes.len()),
            ));
        }
        let ranks = c.key("ranks", "comma-separated ranks", |v| {
            if v.is_empty() {
                return Ok(Vec::new());
            }
            v.split(',').map(parse_int).collect::<Result<Vec<u32>, _>>()
        })?;
        c.end()?;
        let start = i + 1;
        let mut end = start;
        while end < lines.len() && !lines[end].trim_start().starts_with("class ") {
            end += 1;
        }
        let graph = super::parse(&lines[start..end].join("\n")).map_err(|mut e| {
            e.line += start;
            e
        })?;
        p.classes.push(RankClass { ranks, graph });
        i = end;
    }
    Ok(p)
}

fn parse_model(c: &mut Cursor<'_>) -> Result<ModelInfo, ParseError> {
    let layers = c.u32("layers")?;
    let hidden = c.u64("hidden")?;
    let heads = c.u32("heads")?;
    let kv_heads = c.u32("kv_heads")?;
    let head_dim = c.u32("head_dim")?;
    let ffn = c.u64("ffn")?;
    let vocab = c.u64("vocab")?;
    let seq = c.u64("seq")?;
    let norm = c.key("norm", "rmsnorm or layernorm", |v| {
        NormKind::ALL
            .into_iter()
            .find(|n| n.name() == v)
            .ok_or_else(|| "unknown norm".to_string())
    })?;
    let activation = c.key(
        "activation",
        "gelu, relu, swiglu, geglu or squared_relu",
        |v| {
            Activation::ALL
                .into_iter()
                .find(|a| a.name() == v)
                .ok_or_else(|| "unknown activation".to_string())
        },
    )?;
    let learned_positions = c.flag("learned_positions");
    let tied_embeddings = c.flag("tied_embeddings");
    let linear_bias = c.flag("linear_bias");
    let dropout = c.flag("dropout");
    let causal = c.flag("causal");
    let sliding_window = if c.has_key("sliding_window") {
        Some(c.u64("sliding_window")?)
    } else {
        None
    };
    Ok(ModelInfo {
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim,
        ffn,
        vocab,
        seq,
        norm,
        activation,
        learned_positions,
        tied_embeddings,
        linear_bias,
        dropout,
        causal,
        sliding_window,
        attention_sink_tokens: c.u64("sink_tokens")?,
        moe: None,
    })
}

fn parse_run(c: &mut Cursor<'_>) -> Result<RunInfo, ParseError> {
    Ok(RunInfo {
        tp: c.u32("tp")?,
        cp: c.u32("cp")?,
        ep: c.u32("ep")?,
        dp: c.u32("dp")?,
        pp: c.u32("pp")?,
        micro_batch: c.u32("micro_batch")?,
        grad_accum: c.u64("grad_accum")?,
        global_batch: c.u64("global_batch")?,
        zero_stage: c.key("zero", "integer", parse_int)?,
        model_flops: c.key("model_flops", "integer", parse_int)?,
        sequence_parallel: c.flag("sequence_parallel"),
        op_level_recompute: c.flag("op_level_recompute"),
        whole_experts: c.flag("whole_experts"),
    })
}

fn parse_rank(c: &mut Cursor<'_>, p: &mut Program) -> Result<(), ParseError> {
    let at = c.peek();
    let r: u32 = c.id("a rank")?;
    if r as usize != p.class_of.len() {
        return Err(c.err_at(
            at,
            format!("rank {} (ranks come in order)", p.class_of.len()),
        ));
    }
    p.class_of.push(c.u32("class")?);
    let groups = c.key("groups", "comma-separated group ids", |v| {
        if v.is_empty() {
            return Ok(Vec::new());
        }
        v.split(',')
            .map(|g| {
                g.parse::<GroupId>()
                    .map_err(|_| format!("`{g}` is not a group id"))
            })
            .collect()
    })?;
    p.membership.push(groups);
    if c.has_key("coord") {
        let at = c.peek();
        let v: Vec<u32> = c.key("coord", "tp,cp,ep,dp,pp", |v| {
            v.split(',').map(parse_int).collect()
        })?;
        let a: [u32; 5] = v
            .try_into()
            .map_err(|_| c.err_at(at, "five coordinates `coord=tp,cp,ep,dp,pp`"))?;
        if p.coords.len() + 1 != p.class_of.len() {
            return Err(c.err_at(at, "coordinates on every rank line or on none"));
        }
        p.coords.push(Coord::from_array(a));
    } else if !p.coords.is_empty() {
        return Err(c.err_at(
            None,
            "`coord=tp,cp,ep,dp,pp` (the rank lines before have one)",
        ));
    }
    Ok(())
}
