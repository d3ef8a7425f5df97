//! Canonical text form of a graph (print and parse).
//!
//! One line per declaration or node, in the order of the [`Graph`]'s vectors, so golden
//! files diff line by line. [`print()`] is total and [`parse`] inverts it exactly:
//! `parse(&print(g)) == Ok(g)` for **every** graph, valid or not. The parser is purely
//! syntactic (it does not renumber, sort or check references), so invalid graphs can be
//! written by hand for verifier tests; semantic checks live in [`crate::verify`].
//!
//! # Grammar
//!
//! ```text
//! file      := line*                      (lines separated by '\n'; a trailing '\r' is ignored)
//! line      := blank | comment | graph | group | buffer | value | bucket | slice | node
//!                                         (print writes: header comment, graph, groups,
//!                                          buffers, values, buckets, slices, nodes; parse
//!                                          accepts the last six interleaved, appending
//!                                          each to its vector)
//! comment   := ';' any*                   ("; shardwright-ir V" with V != 1 is rejected)
//! graph     := 'graph' 'rank=' U32 'world=' U32          (exactly once, before all else)
//! group     := 'group' GROUPID AXIS'.'U32 FABRIC 'ranks='[U32 (',' U32)*]
//!                                         (AXIS: tp cp ep dp pp dense_dp expert_dp world;
//!                                          any other name is an error; ranks may be empty)
//! buffer    := 'buffer' BUFFERID BUFKIND NAME 'bytes=' U64
//! value     := 'value' VALUEID VALKIND DTYPE'['[U64 (',' U64)*]']' NAME
//!                                         (e.g. `value %3 activation bf16[8,4096] L0.x`)
//! bucket    := 'bucket' NAME AXIS 'padded=' U64 'params=' VALUEID (',' VALUEID)*
//!              ['shard=' VALUEID ',' VALUEID ',' VALUEID ',' VALUEID ',' VALUEID]
//!                                         (a data-parallel bucket: its parameters in
//!                                          flattening order; the ZeRO shard's param, grad,
//!                                          master, exp_avg, exp_avg_sq)
//! slice     := 'slice' VALUEID 'full=' U64 'x' U64 ('whole' | 'rows=' AXIS
//!              | 'cols=' AXIS ':' U64 (',' U64)*)
//!                                         (a parameter's part of the full tensor: whole,
//!                                          row blocks, or column blocks of these widths,
//!                                          cut over the rank's AXIS group)
//! node      := NODEID '=' op [values] ['->' values] '@'STREAM PASS ['mb='U32] ['layer='U32]
//!              ['<-' deps]                (operands, then results)
//! values    := VALUEID (',' VALUEID)*     (printed as "%1, %2")
//! deps      := NODEID (',' NODEID)*       (printed as "n1, n2": comma then space)
//! op        := 'gemm' GEMM 'm=' U64 'n=' U64 'k=' U64 DTYPE ['weight=' PARAM] work
//!            | 'attention' ['causal'] 'heads=' U32 'kv_heads=' U32 'seq_q=' U64
//!              'seq_kv=' U64 'head_dim=' U32 'batch=' U32 ['cp=' U32 '/' U32] ['flash'] work
//!            | 'norm' 'tokens=' U64 'width=' U64 work
//!            | 'elementwise' EWKIND 'elems=' U64 work
//!            | 'embedding' 'tokens=' U64 'hidden=' U64 'vocab=' U64 work
//!            | 'loss' 'tokens=' U64 'vocab=' U64 work
//!            | 'optimizer_step' 'params=' U64 work
//!            | 'collective' COLLKIND GROUPID 'bytes=' U64 DTYPE ['tensor=' NAME] ['reduce=max']
//!                                         (the reduction is `sum` unless `reduce=max` says so)
//!            | 'send' 'peer=' U32 'bytes=' U64 DTYPE
//!            | 'recv' 'peer=' U32 'bytes=' U64 DTYPE
//!            | 'alloc' BUFFERID | 'free' BUFFERID | 'release'
//!            | 'checkpoint' 'every=' U64 'bytes=' U64
//! work      := 'flops=' U64 'bytes=' U64
//! GEMM      := GEMMROLE ['.dgrad' | '.wgrad']
//!                                         (GEMMROLE: qkv k_proj proj fc1 fc1_up fc2 router
//!                                          expert_fc1 expert_fc2 shared_fc1 shared_fc2
//!                                          lm_head; any other name is an error)
//! PARAM     := ['L' U32 '.' [('e' | 'le') U32 '.']] ROLE
//!                                         (ROLE: a parameter role, `vocab::Role`; a layer's
//!                                          roles with `L`, the ends' without)
//! NAME      := [A-Za-z0-9_.:/-]+ | QUOTED
//! QUOTED    := '"' (char | '\\' | '\"' | '\n' | '\r' | '\t' | '\u{' HEX+ '}')* '"'
//! ```
//!
//! Tokens are separated by spaces (`key=value` and `@stream` are single tokens, with no
//! space inside); fields come in exactly the order above (the form is
//! canonical, there is one way to write each graph). Ids are written in their Display
//! form (`n12`, `g3`, `b5`), enums by their `name()` (`bf16`, `all_reduce`, `@comm`,
//! `recompute`, ...), integers in decimal without sign.
//!
//! # Names
//!
//! Names (buffer names, collective tensors; value names print the same way) are meant to be drawn from
//! `[A-Za-z0-9_.:/-]+` and the verifier reports any other name (rule `name`). So that
//! printing stays total and round-trips every graph, the printer *escapes* instead of
//! rejecting: a name outside that set (including the empty name) is printed as a
//! double-quoted string in which `\` and `"` are backslash-escaped and every control or
//! non-space whitespace character is written `\n`, `\r`, `\t` or `\u{HEX}`.
//!
//! Node and group lines of the example:
//! ```text
//! group g0 tp.0 nvlink ranks=0,1,2,3,4,5,6,7
//! n3 = collective all_reduce g0 bytes=33554432 bf16 @comm fwd mb=0 layer=0 <- n2
//! ```

use crate::graph::{
    Bucket, Buffer, BufferKind, CollectiveKind, DType, ElementwiseKind, Fabric, Graph, Node, Op,
    Pass, ProcessGroup, ReduceOp, Shard, Slice, Split, Stream, Value, ValueKind, Work,
};
use crate::ids::{BufferId, GroupId, NodeId, ValueId};
use crate::vocab::Axis;
use std::fmt::{self, Write as _};

mod program;
pub use program::{parse_program, print_program, PROGRAM_HEADER};

/// The first line of every printed graph.
pub const HEADER: &str = "; shardwright-ir 1";

/// Whether `s` may be printed bare (without quotes): non-empty, `[A-Za-z0-9_.:/-]+`.
pub fn is_bare_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'/' | b'-'))
}

fn write_name(out: &mut String, s: &str) {
    if is_bare_name(s) {
        out.push_str(s);
        return;
    }
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() || (c.is_whitespace() && c != ' ') => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The whole graph, one line per declaration and node, ending with a newline.
pub fn print(g: &Graph) -> String {
    let mut out = String::new();
    out.push_str(HEADER);
    out.push('\n');
    let _ = writeln!(out, "graph rank={} world={}", g.rank, g.world);
    for pg in &g.groups {
        write_group(&mut out, pg);
    }
    for b in &g.buffers {
        let _ = write!(out, "buffer {} {} ", b.id, b.kind.name());
        write_name(&mut out, &b.name);
        let _ = writeln!(out, " bytes={}", b.bytes);
    }
    for v in &g.values {
        out.push_str("value %");
        push_int(&mut out, v.id.0 as u64);
        out.push(' ');
        out.push_str(v.kind.name());
        out.push(' ');
        out.push_str(v.dtype.name());
        out.push('[');
        for (i, d) in v.shape.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            push_int(&mut out, *d);
        }
        out.push_str("] ");
        write_name(&mut out, &v.name);
        out.push('\n');
    }
    for b in &g.buckets {
        out.push_str("bucket ");
        write_name(&mut out, &b.name);
        let _ = write!(out, " {} padded={} params=", b.axis, b.padded);
        write_list(&mut out, &b.params);
        if let Some(s) = &b.shard {
            out.push_str(" shard=");
            write_list(&mut out, &s.values());
        }
        out.push('\n');
    }
    for sl in &g.slices {
        let _ = write!(
            out,
            "slice {} full={}x{} ",
            sl.param, sl.full[0], sl.full[1]
        );
        match &sl.split {
            Split::Whole => out.push_str("whole"),
            Split::Rows { axis } => {
                let _ = write!(out, "rows={axis}");
            }
            Split::Cols { axis, blocks } => {
                let _ = write!(out, "cols={axis}:");
                write_list(&mut out, blocks);
            }
        }
        out.push('\n');
    }
    for n in &g.nodes {
        write_node(&mut out, n);
        out.push('\n');
    }
    out
}

/// A `group` line (shared by graphs and programs), with its newline.
fn write_group(out: &mut String, pg: &ProcessGroup) {
    let _ = write!(out, "group {} ", pg.id);
    let _ = write!(out, "{}.{} {} ranks=", pg.axis, pg.index, pg.fabric.name());
    write_list(out, &pg.ranks);
    out.push('\n');
}

/// Comma-separated, no spaces (`0,1,2`).
fn write_list<T: fmt::Display>(out: &mut String, xs: &[T]) {
    for (i, x) in xs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{x}");
    }
}

/// One node as its line of [`print()`] (without the newline); used by verifier messages.
/// `_g` is the graph the node belongs to (the line does not depend on it today).
pub fn print_node(_g: &Graph, n: &Node) -> String {
    let mut out = String::new();
    write_node(&mut out, n);
    out
}

fn write_work(out: &mut String, w: &Work) {
    let _ = write!(out, " flops={} bytes={}", w.flops, w.bytes);
}

fn write_node(out: &mut String, n: &Node) {
    let _ = write!(out, "{} = {}", n.id, n.op.keyword());
    match &n.op {
        Op::Gemm {
            name,
            m,
            n,
            k,
            dtype,
            weight,
            work,
        } => {
            let _ = write!(out, " {name} m={m} n={n} k={k} {}", dtype.name());
            if let Some(w) = weight {
                let _ = write!(out, " weight={w}");
            }
            write_work(out, work);
        }
        Op::Attention {
            causal,
            heads,
            kv_heads,
            seq_q,
            seq_kv,
            head_dim,
            batch,
            cp_chunk,
            flash,
            work,
        } => {
            if *causal {
                out.push_str(" causal");
            }
            let _ = write!(
                out,
                " heads={heads} kv_heads={kv_heads} seq_q={seq_q} seq_kv={seq_kv} \
                 head_dim={head_dim} batch={batch}"
            );
            if let Some((i, c)) = cp_chunk {
                let _ = write!(out, " cp={i}/{c}");
            }
            if *flash {
                out.push_str(" flash");
            }
            write_work(out, work);
        }
        Op::Norm {
            tokens,
            width,
            work,
        } => {
            let _ = write!(out, " tokens={tokens} width={width}");
            write_work(out, work);
        }
        Op::Elementwise { kind, elems, work } => {
            let _ = write!(out, " {} elems={elems}", kind.name());
            write_work(out, work);
        }
        Op::Embedding {
            tokens,
            hidden,
            vocab,
            work,
        } => {
            let _ = write!(out, " tokens={tokens} hidden={hidden} vocab={vocab}");
            write_work(out, work);
        }
        Op::Loss {
            tokens,
            vocab,
            work,
        } => {
            let _ = write!(out, " tokens={tokens} vocab={vocab}");
            write_work(out, work);
        }
        Op::OptimizerStep { params, work } => {
            let _ = write!(out, " params={params}");
            write_work(out, work);
        }
        Op::Collective {
            kind,
            group,
            bytes,
            dtype,
            tensor,
            reduce,
        } => {
            let _ = write!(
                out,
                " {} {group} bytes={bytes} {}",
                kind.name(),
                dtype.name()
            );
            if let Some(t) = tensor {
                out.push_str(" tensor=");
                write_name(out, t);
            }
            if !reduce.is_sum() {
                let _ = write!(out, " reduce={}", reduce.name());
            }
        }
        Op::Send { peer, bytes, dtype } | Op::Recv { peer, bytes, dtype } => {
            let _ = write!(out, " peer={peer} bytes={bytes} {}", dtype.name());
        }
        Op::Alloc { buffer } | Op::Free { buffer } => {
            let _ = write!(out, " {buffer}");
        }
        Op::Checkpoint { every_steps, bytes } => {
            let _ = write!(out, " every={every_steps} bytes={bytes}");
        }
        Op::Release => {}
    }
    for (i, v) in n.operands.iter().enumerate() {
        out.push_str(if i == 0 { " %" } else { ", %" });
        push_int(out, v.0 as u64);
    }
    for (i, v) in n.results.iter().enumerate() {
        out.push_str(if i == 0 { " -> %" } else { ", %" });
        push_int(out, v.0 as u64);
    }
    out.push_str(" @");
    out.push_str(n.stream.name());
    out.push(' ');
    out.push_str(n.pass.name());
    if let Some(mb) = n.mb {
        out.push_str(" mb=");
        push_int(out, mb as u64);
    }
    if let Some(l) = n.layer {
        out.push_str(" layer=");
        push_int(out, l as u64);
    }
    for (i, d) in n.deps.iter().enumerate() {
        out.push_str(if i == 0 { " <- n" } else { ", n" });
        push_int(out, d.0 as u64);
    }
}

/// Append `x` in decimal (the printer's hot path: a 16,384-GPU program prints ~10^6 ids,
/// and `write!` formats each through `core::fmt`; the lowering names its values with it).
pub fn push_int(out: &mut String, mut x: u64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (x % 10) as u8;
        x /= 10;
        if x == 0 {
            break;
        }
    }
    out.push_str(std::str::from_utf8(&buf[i..]).expect("ascii digits"));
}

/// A syntax error: where (1-based line and column, in characters), what token was found
/// there, and what was expected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    pub line: usize,
    pub column: usize,
    /// The offending token, or `end of line` / `end of input`.
    pub found: String,
    /// What the parser expected at that point.
    pub expected: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "line {}, column {}: expected {}, found {}",
            self.line, self.column, self.expected, self.found
        )
    }
}

impl std::error::Error for ParseError {}

const EOL: &str = "end of line";

#[derive(Clone, Copy)]
struct Tok<'a> {
    text: &'a str,
    /// 1-based character column.
    col: usize,
}

/// Split a line at spaces/whitespace outside double quotes.
fn tokenize(line: &str, lineno: usize) -> Result<Vec<Tok<'_>>, ParseError> {
    let mut toks = Vec::new();
    let mut chars = line.char_indices().enumerate().peekable();
    while let Some(&(col0, (start, c))) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        let mut end = line.len();
        let mut in_quote = false;
        let mut escaped = false;
        let mut quote_col = 0;
        while let Some(&(col, (i, c))) = chars.peek() {
            if in_quote {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == '"' {
                    in_quote = false;
                }
            } else if c.is_whitespace() {
                end = i;
                break;
            } else if c == '"' {
                in_quote = true;
                quote_col = col;
            }
            chars.next();
        }
        if in_quote {
            return Err(ParseError {
                line: lineno,
                column: quote_col + 1,
                found: format!("`{}`", &line[start..]),
                expected: "a closing `\"`".into(),
            });
        }
        toks.push(Tok {
            text: &line[start..end],
            col: col0 + 1,
        });
    }
    Ok(toks)
}

/// Decode a name at the start of `s`: a quoted string (returning the rest of `s` after the
/// closing quote) or else all of `s` as a bare name.
fn decode_name(s: &str) -> Result<(String, &str), String> {
    if let Some(body) = s.strip_prefix('"') {
        let mut out = String::new();
        let mut it = body.char_indices();
        while let Some((i, c)) = it.next() {
            match c {
                '"' => return Ok((out, &body[i + 1..])),
                '\\' => match it.next() {
                    Some((_, '"')) => out.push('"'),
                    Some((_, '\\')) => out.push('\\'),
                    Some((_, 'n')) => out.push('\n'),
                    Some((_, 'r')) => out.push('\r'),
                    Some((_, 't')) => out.push('\t'),
                    Some((j, 'u')) => {
                        let rest = &body[j + 1..];
                        let close = rest
                            .strip_prefix('{')
                            .and_then(|r| r.find('}').map(|e| &r[..e]))
                            .ok_or("`\\u{HEX}` escape")?;
                        let hex = close.bytes().all(|b| b.is_ascii_hexdigit());
                        let ch = (hex && !close.is_empty() && close.len() <= 6)
                            .then(|| u32::from_str_radix(close, 16).ok())
                            .flatten()
                            .and_then(char::from_u32)
                            .ok_or("a valid `\\u{HEX}` code point")?;
                        out.push(ch);
                        for _ in 0..close.len() + 2 {
                            it.next();
                        }
                    }
                    _ => {
                        return Err(
                            "an escape (`\\\"`, `\\\\`, `\\n`, `\\r`, `\\t`, `\\u{HEX}`)".into(),
                        )
                    }
                },
                c => out.push(c),
            }
        }
        Err("a closing `\"`".into())
    } else if is_bare_name(s) {
        Ok((s.to_string(), ""))
    } else {
        Err("a name (`[A-Za-z0-9_.:/-]+` or a quoted string)".into())
    }
}

struct Cursor<'a> {
    toks: Vec<Tok<'a>>,
    pos: usize,
    line: usize,
    line_len: usize,
}

impl<'a> Cursor<'a> {
    /// The tokens of `line` (line number `lineno`), before the first.
    fn of_line(line: &'a str, lineno: usize) -> Result<Self, ParseError> {
        Ok(Cursor {
            toks: tokenize(line, lineno)?,
            pos: 0,
            line: lineno,
            line_len: line.chars().count(),
        })
    }
    fn err_at(&self, tok: Option<Tok<'a>>, expected: impl Into<String>) -> ParseError {
        match tok {
            Some(t) => ParseError {
                line: self.line,
                column: t.col,
                found: format!("`{}`", t.text),
                expected: expected.into(),
            },
            None => ParseError {
                line: self.line,
                column: self.line_len + 1,
                found: EOL.into(),
                expected: expected.into(),
            },
        }
    }
    fn peek(&self) -> Option<Tok<'a>> {
        self.toks.get(self.pos).copied()
    }
    fn next(&mut self, expected: &str) -> Result<Tok<'a>, ParseError> {
        let t = self.peek().ok_or_else(|| self.err_at(None, expected))?;
        self.pos += 1;
        Ok(t)
    }
    fn keyword(&mut self, kw: &str) -> Result<(), ParseError> {
        let exp = format!("`{kw}`");
        let t = self.next(&exp)?;
        if t.text == kw {
            Ok(())
        } else {
            Err(self.err_at(Some(t), exp))
        }
    }
    fn flag(&mut self, kw: &str) -> bool {
        if self.peek().is_some_and(|t| t.text == kw) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    /// `key=value` with the value checked by `f` (which names what it expects on error).
    fn key<T>(
        &mut self,
        key: &str,
        what: &str,
        f: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<T, ParseError> {
        let exp = format!("`{key}=<{what}>`");
        let t = self.next(&exp)?;
        let v = t
            .text
            .strip_prefix(key)
            .and_then(|r| r.strip_prefix('='))
            .ok_or_else(|| self.err_at(Some(t), exp.clone()))?;
        f(v).map_err(|e| self.err_at(Some(t), format!("`{key}=<{what}>`: {e}")))
    }
    fn has_key(&self, key: &str) -> bool {
        self.peek()
            .is_some_and(|t| t.text.strip_prefix(key).is_some_and(|r| r.starts_with('=')))
    }
    fn u64(&mut self, key: &str) -> Result<u64, ParseError> {
        self.key(key, "integer", parse_int)
    }
    fn u32(&mut self, key: &str) -> Result<u32, ParseError> {
        self.key(key, "integer", parse_int)
    }
    fn opt_u32(&mut self, key: &str) -> Result<Option<u32>, ParseError> {
        if self.has_key(key) {
            self.u32(key).map(Some)
        } else {
            Ok(None)
        }
    }
    /// An optional `key=NAME` (bare or quoted).
    fn opt_name(&mut self, key: &str) -> Result<Option<String>, ParseError> {
        if !self.has_key(key) {
            return Ok(None);
        }
        let exp = format!("`{key}=<name>`");
        let t = self.next(&exp)?;
        let v = &t.text[key.len() + 1..];
        let (w, rest) = decode_name(v).map_err(|e| self.err_at(Some(t), format!("{exp}: {e}")))?;
        if !rest.is_empty() {
            return Err(self.err_at(Some(t), "a space after the closing `\"`"));
        }
        Ok(Some(w))
    }
    fn name(&mut self, what: &str) -> Result<String, ParseError> {
        let t = self.next(what)?;
        decode_name(t.text)
            .and_then(|(n, rest)| {
                if rest.is_empty() {
                    Ok(n)
                } else {
                    Err("a space after the closing `\"`".into())
                }
            })
            .map_err(|e| self.err_at(Some(t), format!("{what}: {e}")))
    }
    fn parse_tok<T>(
        &mut self,
        what: &str,
        f: impl FnOnce(&str) -> Option<T>,
    ) -> Result<T, ParseError> {
        let t = self.next(what)?;
        f(t.text).ok_or_else(|| self.err_at(Some(t), what))
    }
    /// Same, with the parser's reason in the error (an unknown role names the known ones).
    fn parse_tok_or<T>(
        &mut self,
        what: &str,
        f: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<T, ParseError> {
        let t = self.next(what)?;
        f(t.text).map_err(|e| self.err_at(Some(t), format!("{what}: {e}")))
    }
    fn id<T: std::str::FromStr>(&mut self, what: &str) -> Result<T, ParseError> {
        self.parse_tok(what, |s| s.parse().ok())
    }
    fn work(&mut self) -> Result<Work, ParseError> {
        Ok(Work {
            flops: self.u64("flops")?,
            bytes: self.u64("bytes")?,
        })
    }
    fn dtype(&mut self) -> Result<DType, ParseError> {
        self.parse_tok("a dtype (f32, bf16, f16, fp8)", |s| {
            DType::ALL.into_iter().find(|d| d.name() == s)
        })
    }
    /// A comma-separated list of ids (`a, b, c`: each but the last ends with a comma).
    fn list<T: std::str::FromStr>(&mut self, what: &str) -> Result<Vec<T>, ParseError> {
        let mut out = Vec::new();
        loop {
            let t = self.next(what)?;
            let (text, more) = match t.text.strip_suffix(',') {
                Some(s) => (s, true),
                None => (t.text, false),
            };
            out.push(text.parse().map_err(|_| self.err_at(Some(t), what))?);
            if !more {
                return Ok(out);
            }
        }
    }

    fn end(&self) -> Result<(), ParseError> {
        match self.peek() {
            None => Ok(()),
            Some(t) => Err(self.err_at(Some(t), EOL)),
        }
    }
}

fn parse_int<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err("not a decimal integer".into());
    }
    s.parse().map_err(|_| "integer out of range".into())
}

fn one_of<T: Copy>(all: &[T], name: impl Fn(T) -> &'static str, s: &str) -> Option<T> {
    all.iter().copied().find(|&x| name(x) == s)
}

const FABRICS: [Fabric; 2] = [Fabric::Nvlink, Fabric::Network];

/// Parse the text form (see the module doc). Syntactic only: ids are taken as written.
pub fn parse(s: &str) -> Result<Graph, ParseError> {
    let mut graph: Option<Graph> = None;
    let mut last_line = 0;
    for (i, raw) in s.split('\n').enumerate() {
        let lineno = i + 1;
        last_line = lineno;
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        let trimmed = line.trim_start();
        if trimmed.is_empty() {
            continue;
        }
        if let Some(comment) = trimmed.strip_prefix(';') {
            let mut words = comment.split_whitespace();
            if words.next() == Some("shardwright-ir") {
                if let Some(v) = words.next().filter(|v| *v != "1") {
                    return Err(ParseError {
                        line: lineno,
                        column: line.chars().count() - trimmed.chars().count() + 1,
                        found: format!("version `{v}`"),
                        expected: "`; shardwright-ir 1`".into(),
                    });
                }
            }
            continue;
        }
        let mut c = Cursor::of_line(line, lineno)?;
        let Some(g) = graph.as_mut() else {
            c.keyword("graph")?;
            let rank = c.u32("rank")?;
            let world = c.u32("world")?;
            c.end()?;
            graph = Some(Graph::new(rank, world));
            continue;
        };
        parse_line(&mut c, g)?;
        c.end()?;
    }
    graph.ok_or_else(|| ParseError {
        line: last_line.max(1),
        column: 1,
        found: "end of input".into(),
        expected: "`graph rank=<integer> world=<integer>`".into(),
    })
}

/// A `group` line after its keyword (shared by graphs and programs).
fn parse_group(c: &mut Cursor<'_>) -> Result<ProcessGroup, ParseError> {
    let id: GroupId = c.id("a group id (`gN`)")?;
    let what = "a group name `<axis>.<index>`";
    let t = c.next(what)?;
    let (axis, index) = (|| {
        let (a, idx) = t.text.rsplit_once('.').ok_or("`.<index>`")?;
        Ok::<_, String>((a.parse::<Axis>()?, parse_int(idx)?))
    })()
    .map_err(|e| c.err_at(Some(t), format!("{what}: {e}")))?;
    let fabric = c.parse_tok("a fabric (nvlink, network)", |s| {
        one_of(&FABRICS, Fabric::name, s)
    })?;
    let ranks = c.key("ranks", "comma-separated ranks", |v| {
        if v.is_empty() {
            Ok(Vec::new())
        } else {
            v.split(',').map(parse_int).collect()
        }
    })?;
    Ok(ProcessGroup {
        id,
        axis,
        index,
        ranks,
        fabric,
    })
}

fn parse_line(c: &mut Cursor<'_>, g: &mut Graph) -> Result<(), ParseError> {
    let first = c.peek().expect("non-empty line has a token");
    match first.text {
        "group" => {
            c.pos += 1;
            g.groups.push(parse_group(c)?);
        }
        "buffer" => {
            c.pos += 1;
            let id: BufferId = c.id("a buffer id (`bN`)")?;
            let kind = c.parse_tok("a buffer kind", |s| {
                one_of(&BufferKind::ALL, BufferKind::name, s)
            })?;
            let name = c.name("a buffer name")?;
            let bytes = c.u64("bytes")?;
            g.buffers.push(Buffer {
                id,
                name,
                kind,
                bytes,
            });
        }
        "value" => {
            c.pos += 1;
            let id: ValueId = c.id("a value id (`%N`)")?;
            let kind = c.parse_tok(
                "a value kind (param, grad, master, moment, data, activation)",
                |s| one_of(&ValueKind::ALL, ValueKind::name, s),
            )?;
            let what = "a typed shape `<dtype>[<dims>]` (e.g. `bf16[8,4096]`)";
            let t = c.next(what)?;
            let (dtype, shape) = (|| {
                let (dt, rest) = t.text.split_once('[').ok_or("`[`")?;
                let dims = rest.strip_suffix(']').ok_or("`]`")?;
                let dtype = one_of(&DType::ALL, DType::name, dt)
                    .ok_or_else(|| format!("a dtype, not `{dt}`"))?;
                let shape = if dims.is_empty() {
                    Vec::new()
                } else {
                    dims.split(',').map(parse_int).collect::<Result<_, _>>()?
                };
                Ok::<_, String>((dtype, shape))
            })()
            .map_err(|e| c.err_at(Some(t), format!("{what}: {e}")))?;
            let name = c.name("a value name")?;
            g.values.push(Value {
                id,
                kind,
                dtype,
                shape: shape.into(),
                name,
            });
        }
        "bucket" => {
            c.pos += 1;
            let name = c.name("a bucket name")?;
            let axis = c.parse_tok("an axis (dense_dp, expert_dp, ...)", |s| {
                s.parse::<Axis>().ok()
            })?;
            let padded = c.u64("padded")?;
            let params = c.key("params", "comma-separated value ids (`%N`)", |v| {
                if v.is_empty() {
                    return Ok(Vec::new());
                }
                v.split(',')
                    .map(|x| x.parse::<ValueId>())
                    .collect::<Result<Vec<_>, _>>()
            })?;
            let shard = if c.has_key("shard") {
                let ids = c.key("shard", "five value ids (`%N`)", |v| {
                    let ids = v
                        .split(',')
                        .map(|x| x.parse::<ValueId>())
                        .collect::<Result<Vec<_>, _>>()?;
                    <[ValueId; 5]>::try_from(ids)
                        .map_err(|ids| format!("five value ids, not {}", ids.len()))
                })?;
                Some(Shard {
                    param: ids[0],
                    grad: ids[1],
                    master: ids[2],
                    exp_avg: ids[3],
                    exp_avg_sq: ids[4],
                })
            } else {
                None
            };
            g.buckets.push(Bucket {
                name,
                axis,
                params,
                padded,
                shard,
            });
        }
        "slice" => {
            c.pos += 1;
            let param: ValueId = c.id("a parameter's value id (`%N`)")?;
            let full = c.key("full", "ROWSxCOLS", |v| {
                let (r, k) = v.split_once('x').ok_or("ROWSxCOLS, e.g. `64x192`")?;
                Ok::<_, String>([parse_int(r)?, parse_int(k)?])
            })?;
            let axis_of = |v: &str| {
                v.parse::<Axis>()
                    .map_err(|_| format!("an axis (tp, ep, ...), not `{v}`"))
            };
            let split = if c.flag("whole") {
                Split::Whole
            } else if c.has_key("rows") {
                Split::Rows {
                    axis: c.key("rows", "axis", axis_of)?,
                }
            } else {
                let (axis, blocks) = c.key("cols", "AXIS:WIDTH,WIDTH,...", |v| {
                    let (a, w) = v.split_once(':').ok_or("AXIS:WIDTH,... (`tp:128,32,32`)")?;
                    let blocks = w
                        .split(',')
                        .filter(|x| !x.is_empty() || !w.is_empty())
                        .map(parse_int)
                        .collect::<Result<Vec<u64>, String>>()?;
                    Ok::<_, String>((axis_of(a)?, blocks))
                })?;
                Split::Cols { axis, blocks }
            };
            g.slices.push(Slice { param, full, split });
        }
        "graph" => return Err(c.err_at(
            Some(first),
            "`group`, `buffer`, `value`, `bucket`, `slice` or a node id (`nN`); the `graph` line comes once",
        )),
        _ => {
            let id: NodeId = c.id("`group`, `buffer`, `value` or a node id (`nN`)")?;
            c.keyword("=")?;
            let op = parse_op(c)?;
            let operands = match c.peek() {
                Some(t) if t.text.starts_with('%') => c.list("a value id (`%N`)")?,
                _ => Vec::new(),
            };
            let results = if c.flag("->") {
                c.list("a value id (`%N`)")?
            } else {
                Vec::new()
            };
            let stream = c.parse_tok(
                "a stream (`@compute`, `@comm`, `@p2p`, `@dp`, `@io`)",
                |s| {
                    s.strip_prefix('@')
                        .and_then(|s| one_of(&Stream::ALL, Stream::name, s))
                },
            )?;
            let pass = c.parse_tok("a pass (fwd, bwd, recompute, step)", |s| {
                one_of(&Pass::ALL, Pass::name, s)
            })?;
            let mb = c.opt_u32("mb")?;
            let layer = c.opt_u32("layer")?;
            let deps = if c.flag("<-") {
                c.list("a node id (`nN`)")?
            } else {
                Vec::new()
            };
            g.nodes.push(Node {
                id,
                stream,
                pass,
                mb,
                layer,
                op,
                deps,
                operands: operands.into(),
                results: results.into(),
            });
        }
    }
    Ok(())
}

fn parse_op(c: &mut Cursor<'_>) -> Result<Op, ParseError> {
    const OPS: &str = "an op (gemm, attention, norm, elementwise, embedding, loss, \
                       optimizer_step, collective, send, recv, alloc, free, release, \
                       checkpoint)";
    let t = c.next(OPS)?;
    Ok(match t.text {
        "gemm" => {
            let name = c.parse_tok_or("a gemm name (`<role>[.dgrad|.wgrad]`)", str::parse)?;
            let m = c.u64("m")?;
            let n = c.u64("n")?;
            let k = c.u64("k")?;
            let dtype = c.dtype()?;
            let weight = if c.has_key("weight") {
                Some(c.key("weight", "parameter name", str::parse)?)
            } else {
                None
            };
            Op::Gemm {
                name,
                m,
                n,
                k,
                dtype,
                weight,
                work: c.work()?,
            }
        }
        "attention" => {
            let causal = c.flag("causal");
            let heads = c.u32("heads")?;
            let kv_heads = c.u32("kv_heads")?;
            let seq_q = c.u64("seq_q")?;
            let seq_kv = c.u64("seq_kv")?;
            let head_dim = c.u32("head_dim")?;
            let batch = c.u32("batch")?;
            let cp_chunk = if c.has_key("cp") {
                Some(c.key("cp", "chunk/chunks", |v| {
                    let (a, b) = v.split_once('/').ok_or("`<chunk>/<chunks>`")?;
                    Ok((parse_int(a)?, parse_int(b)?))
                })?)
            } else {
                None
            };
            let flash = c.flag("flash");
            Op::Attention {
                causal,
                heads,
                kv_heads,
                seq_q,
                seq_kv,
                head_dim,
                batch,
                cp_chunk,
                flash,
                work: c.work()?,
            }
        }
        "norm" => Op::Norm {
            tokens: c.u64("tokens")?,
            width: c.u64("width")?,
            work: c.work()?,
        },
        "elementwise" => Op::Elementwise {
            kind: c.parse_tok("an elementwise kind", |s| {
                one_of(&ElementwiseKind::ALL, ElementwiseKind::name, s)
            })?,
            elems: c.u64("elems")?,
            work: c.work()?,
        },
        "embedding" => Op::Embedding {
            tokens: c.u64("tokens")?,
            hidden: c.u64("hidden")?,
            vocab: c.u64("vocab")?,
            work: c.work()?,
        },
        "loss" => Op::Loss {
            tokens: c.u64("tokens")?,
            vocab: c.u64("vocab")?,
            work: c.work()?,
        },
        "optimizer_step" => Op::OptimizerStep {
            params: c.u64("params")?,
            work: c.work()?,
        },
        "collective" => Op::Collective {
            kind: c.parse_tok("a collective kind", |s| {
                one_of(&CollectiveKind::ALL, CollectiveKind::name, s)
            })?,
            group: c.id("a group id (`gN`)")?,
            bytes: c.u64("bytes")?,
            dtype: c.dtype()?,
            tensor: c.opt_name("tensor")?,
            reduce: if c.has_key("reduce") {
                // Canonical: the default `sum` is never written.
                c.key("reduce", "max", |v| match v {
                    "max" => Ok(ReduceOp::Max),
                    _ => Err("only `max` is written (`sum` is the default)".to_string()),
                })?
            } else {
                ReduceOp::Sum
            },
        },
        "send" => Op::Send {
            peer: c.u32("peer")?,
            bytes: c.u64("bytes")?,
            dtype: c.dtype()?,
        },
        "recv" => Op::Recv {
            peer: c.u32("peer")?,
            bytes: c.u64("bytes")?,
            dtype: c.dtype()?,
        },
        "alloc" => Op::Alloc {
            buffer: c.id("a buffer id (`bN`)")?,
        },
        "free" => Op::Free {
            buffer: c.id("a buffer id (`bN`)")?,
        },
        "release" => Op::Release,
        "checkpoint" => Op::Checkpoint {
            every_steps: c.u64("every")?,
            bytes: c.u64("bytes")?,
        },
        _ => return Err(c.err_at(Some(t), OPS)),
    })
}
