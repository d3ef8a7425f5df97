//! The compile check of the CUDA kernels, without a GPU: every file of
//! `executor/kernels/` (through the registry, `shardwright_executor::cuda::kernels`) is
//! compiled by NVRTC to PTX for sm_80 and sm_90, and the PTX by `ptxas -v` to machine code;
//! the registers and spills of every kernel are printed as a table.
//!
//! Fails on: a compile error or warning (NVRTC or ptxas), a registry entry point missing
//! from the PTX or a PTX entry missing from the registry, a `.cu` file missing from the
//! registry, and any register spill in a hot kernel (attention, norms, cross-entropy).
//!
//! The tools come from NVIDIA's pip wheels, installed by `scripts/gpu/install-cuda-tools.sh`
//! into `target/cuda-tools` (or `$SHARDWRIGHT_CUDA_TOOLS`). NVRTC is loaded by hand with
//! `libloading` (no driver needed); `SHARDWRIGHT_NVRTC_LIB`, `SHARDWRIGHT_PTXAS` and
//! `SHARDWRIGHT_CUDA_INCLUDE` name each one instead. Without the tools the test prints why and passes,
//! except under `CI=true`, where missing tools fail it.
//!
//! `cargo test -p shardwright-executor --test nvrtc_compile -- --nocapture` shows the table.

use libloading::{Library, Symbol};
use shardwright_executor::cuda::kernels::{nvrtc_options, KernelFile, FILES};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

const ARCHS: [u32; 2] = [80, 90];

fn tools_dir() -> PathBuf {
    match std::env::var_os("SHARDWRIGHT_CUDA_TOOLS") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cuda-tools"),
    }
}

struct Tools {
    nvrtc: PathBuf,
    ptxas: PathBuf,
    include: PathBuf,
}

fn find_tools() -> Result<Tools, String> {
    let d = tools_dir();
    // Each tool can also be named on its own (scripts/gpu/check.sh does, on a machine whose
    // CUDA is a toolkit install or CUDA 13's pip layout rather than the pinned 12.9 wheels).
    let pick = |var: &str, default: PathBuf| std::env::var_os(var).map_or(default, PathBuf::from);
    let t = Tools {
        nvrtc: pick(
            "SHARDWRIGHT_NVRTC_LIB",
            d.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12"),
        ),
        ptxas: pick("SHARDWRIGHT_PTXAS", d.join("nvidia/cuda_nvcc/bin/ptxas")),
        include: pick(
            "SHARDWRIGHT_CUDA_INCLUDE",
            d.join("nvidia/cuda_runtime/include"),
        ),
    };
    for p in [&t.nvrtc, &t.ptxas, &t.include.join("cuda_bf16.h")] {
        if !p.exists() {
            return Err(format!(
                "{} is missing: run scripts/gpu/install-cuda-tools.sh (or set SHARDWRIGHT_CUDA_TOOLS)",
                p.display()
            ));
        }
    }
    Ok(t)
}

type Prog = *mut c_void;

/// The NVRTC entry points this test needs (nvrtc.h).
struct Nvrtc {
    lib: Library,
}

impl Nvrtc {
    fn load(path: &Path) -> Nvrtc {
        // SAFETY: loading NVIDIA's libnvrtc runs its initializers only.
        let lib = unsafe { Library::new(path) }
            .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
        Nvrtc { lib }
    }

    fn sym<T>(&self, name: &[u8]) -> Symbol<'_, T> {
        // SAFETY: the types below are the signatures in nvrtc.h.
        unsafe { self.lib.get(name) }
            .unwrap_or_else(|e| panic!("{}: {e}", String::from_utf8_lossy(name)))
    }

    fn error_string(&self, code: c_int) -> String {
        let f: Symbol<unsafe extern "C" fn(c_int) -> *const c_char> =
            self.sym(b"nvrtcGetErrorString");
        // SAFETY: NVRTC returns a static C string.
        unsafe { CStr::from_ptr(f(code)) }
            .to_string_lossy()
            .into_owned()
    }

    fn version(&self) -> (i32, i32) {
        let f: Symbol<unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int> =
            self.sym(b"nvrtcVersion");
        let (mut a, mut b) = (0, 0);
        // SAFETY: two out-parameters.
        assert_eq!(unsafe { f(&mut a, &mut b) }, 0);
        (a, b)
    }

    /// `(PTX, log)` or the error with the log.
    fn compile(&self, src: &str, name: &str, opts: &[String]) -> Result<(String, String), String> {
        type Create = unsafe extern "C" fn(
            *mut Prog,
            *const c_char,
            *const c_char,
            c_int,
            *const *const c_char,
            *const *const c_char,
        ) -> c_int;
        type CompileFn = unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int;
        type SizeFn = unsafe extern "C" fn(Prog, *mut usize) -> c_int;
        type GetFn = unsafe extern "C" fn(Prog, *mut c_char) -> c_int;
        type Destroy = unsafe extern "C" fn(*mut Prog) -> c_int;
        let create: Symbol<Create> = self.sym(b"nvrtcCreateProgram");
        let compile: Symbol<CompileFn> = self.sym(b"nvrtcCompileProgram");
        let log_size: Symbol<SizeFn> = self.sym(b"nvrtcGetProgramLogSize");
        let get_log: Symbol<GetFn> = self.sym(b"nvrtcGetProgramLog");
        let ptx_size: Symbol<SizeFn> = self.sym(b"nvrtcGetPTXSize");
        let get_ptx: Symbol<GetFn> = self.sym(b"nvrtcGetPTX");
        let destroy: Symbol<Destroy> = self.sym(b"nvrtcDestroyProgram");

        let csrc = CString::new(src).unwrap();
        let cname = CString::new(name).unwrap();
        let copts: Vec<CString> = opts
            .iter()
            .map(|o| CString::new(o.as_str()).unwrap())
            .collect();
        let popts: Vec<*const c_char> = copts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        let read = |size: &Symbol<SizeFn>, get: &Symbol<GetFn>, prog: Prog| -> String {
            let mut n = 0usize;
            // SAFETY: a buffer of the size NVRTC reports, then a NUL-terminated string.
            unsafe {
                size(prog, &mut n);
                let mut buf = vec![0u8; n.max(1)];
                get(prog, buf.as_mut_ptr() as *mut c_char);
                CStr::from_bytes_until_nul(&buf)
                    .map(|c| c.to_string_lossy().into_owned())
                    .unwrap_or_default()
            }
        };
        // SAFETY: valid C strings and arrays that outlive the calls; the program is
        // destroyed once.
        unsafe {
            let r = create(
                &mut prog,
                csrc.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if r != 0 {
                return Err(format!("nvrtcCreateProgram: {}", self.error_string(r)));
            }
            let r = compile(prog, popts.len() as c_int, popts.as_ptr());
            let log = read(&log_size, &get_log, prog);
            let out = if r != 0 {
                Err(format!("{}\n{log}", self.error_string(r)))
            } else {
                Ok((read(&ptx_size, &get_ptx, prog), log))
            };
            destroy(&mut prog);
            out
        }
    }
}

/// One kernel's figures from `ptxas -v`.
#[derive(Clone, Debug, Default, PartialEq)]
struct Figures {
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
    stack: u32,
    smem: u32,
}

/// `ptxas -v` output -> figures per entry function.
fn parse_ptxas(out: &str) -> BTreeMap<String, Figures> {
    let mut res: BTreeMap<String, Figures> = BTreeMap::new();
    let mut cur: Option<String> = None;
    let num_before = |line: &str, what: &str| -> Option<u32> {
        let i = line.find(what)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    for line in out.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap().to_string();
            res.entry(name.clone()).or_default();
            cur = Some(name);
            continue;
        }
        let Some(name) = &cur else { continue };
        let f = res.get_mut(name).unwrap();
        if line.contains("bytes spill stores") {
            f.stack = num_before(line, "bytes stack frame").unwrap_or(0);
            f.spill_stores = num_before(line, "bytes spill stores").unwrap();
            f.spill_loads = num_before(line, "bytes spill loads").unwrap();
        }
        if line.contains("Used ") && line.contains(" registers") {
            f.registers = num_before(line, "registers").unwrap();
            f.smem = num_before(line, "bytes smem").unwrap_or(0);
        }
    }
    res
}

fn ptx_entries(ptx: &str) -> BTreeSet<String> {
    ptx.lines()
        .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
        .map(|l| l.split('(').next().unwrap().trim().to_string())
        .collect()
}

struct Row {
    file: &'static str,
    hot: bool,
    entry: String,
    per_arch: Vec<Figures>,
}

fn compile_all(t: &Tools) -> (Vec<Row>, Vec<String>) {
    let nvrtc = Nvrtc::load(&t.nvrtc);
    eprintln!(
        "NVRTC {:?} from {}; ptxas {}",
        nvrtc.version(),
        t.nvrtc.display(),
        t.ptxas.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let mut rows: Vec<Row> = Vec::new();
    let mut errors = Vec::new();
    for f in FILES {
        let mut figures: Vec<BTreeMap<String, Figures>> = Vec::new();
        for sm in ARCHS {
            let mut opts = nvrtc_options(sm);
            opts.push(format!("-I{}", t.include.display()));
            let (ptx, log) = match nvrtc.compile(&f.source(), f.file, &opts) {
                Ok(x) => x,
                Err(e) => {
                    errors.push(format!("{} (compute_{sm}): NVRTC: {e}", f.file));
                    figures.push(BTreeMap::new());
                    continue;
                }
            };
            if !log.trim().is_empty() {
                errors.push(format!("{} (compute_{sm}): NVRTC warnings:\n{log}", f.file));
            }
            let entries = ptx_entries(&ptx);
            let want: BTreeSet<String> = f.entries.iter().map(|s| s.to_string()).collect();
            if entries != want {
                errors.push(format!(
                    "{}: PTX entries and registry differ: only in PTX {:?}, only in the registry {:?}",
                    f.file,
                    entries.difference(&want).collect::<Vec<_>>(),
                    want.difference(&entries).collect::<Vec<_>>()
                ));
            }
            let ptx_path = dir.path().join(format!("{}.sm{sm}.ptx", f.file));
            std::fs::write(&ptx_path, &ptx).unwrap();
            let out = Command::new(&t.ptxas)
                .arg(format!("-arch=sm_{sm}"))
                .arg("-v")
                .arg("--warn-on-spills")
                .arg(&ptx_path)
                .arg("-o")
                .arg(ptx_path.with_extension("cubin"))
                .output()
                .unwrap_or_else(|e| panic!("running {}: {e}", t.ptxas.display()));
            let text = String::from_utf8_lossy(&out.stderr).into_owned()
                + &String::from_utf8_lossy(&out.stdout);
            if !out.status.success() {
                errors.push(format!("{} (sm_{sm}): ptxas failed:\n{text}", f.file));
            }
            let figs = parse_ptxas(&text);
            for e in f.entries {
                if !figs.contains_key(*e) {
                    errors.push(format!(
                        "{} (sm_{sm}): ptxas reported nothing for {e}",
                        f.file
                    ));
                }
            }
            figures.push(figs);
        }
        for e in f.entries {
            rows.push(Row {
                file: f.file,
                hot: f.hot,
                entry: e.to_string(),
                per_arch: figures
                    .iter()
                    .map(|m| m.get(*e).cloned().unwrap_or_default())
                    .collect(),
            });
        }
    }
    (rows, errors)
}

fn table(rows: &[Row]) -> String {
    let mut s = format!(
        "{:<16} {:<26} {:>4} {:>5} {:>11} {:>5} {:>11} {:>6}\n",
        "file", "kernel", "hot", "regs80", "spill80 s/l", "regs90", "spill90 s/l", "smem90"
    );
    for r in rows {
        let (a, b) = (&r.per_arch[0], &r.per_arch[1]);
        s += &format!(
            "{:<16} {:<26} {:>4} {:>5} {:>11} {:>5} {:>11} {:>6}\n",
            r.file,
            r.entry,
            if r.hot { "yes" } else { "" },
            a.registers,
            format!("{}/{}", a.spill_stores, a.spill_loads),
            b.registers,
            format!("{}/{}", b.spill_stores, b.spill_loads),
            b.smem
        );
    }
    s
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_without_hot_spills() {
    let tools = match find_tools() {
        Ok(t) => t,
        Err(why) => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("CI=true and the CUDA compile tools are missing: {why}");
            }
            eprintln!("skipped: {why}");
            return;
        }
    };
    let (rows, mut errors) = compile_all(&tools);
    eprintln!("{}", table(&rows));
    for r in &rows {
        for (sm, f) in ARCHS.iter().zip(&r.per_arch) {
            let spilled = f.spill_stores + f.spill_loads > 0;
            if spilled && r.hot {
                errors.push(format!(
                    "{} (sm_{sm}): hot kernel {} spills ({} bytes stored, {} loaded)",
                    r.file, r.entry, f.spill_stores, f.spill_loads
                ));
            } else if spilled {
                eprintln!("note: {} spills on sm_{sm} (not a hot kernel)", r.entry);
            }
        }
    }
    assert!(
        errors.is_empty(),
        "{} problem(s):\n{}",
        errors.len(),
        errors.join("\n")
    );
}

/// Every `.cu` file of `executor/kernels/` is in the registry (so the check above sees it)
/// and every registry file exists; runs without the tools.
#[test]
fn registry_lists_every_kernel_file() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cu"))
        .collect();
    let registered: BTreeSet<String> = FILES.iter().map(|f| f.file.to_string()).collect();
    assert_eq!(on_disk, registered, "executor/kernels/*.cu vs the registry");
    for f in FILES {
        let text = std::fs::read_to_string(dir.join(f.file)).unwrap();
        assert_eq!(text, f.text, "{}: the embedded text is stale", f.file);
        let src: &KernelFile = f;
        assert!(
            src.text.contains("#include \"common.cuh\""),
            "{} does not include common.cuh",
            f.file
        );
        assert!(
            !src.source().contains("#include \"common.cuh\""),
            "{}: common.cuh not inlined",
            f.file
        );
        let mut seen = BTreeSet::new();
        for e in f.entries {
            assert!(seen.insert(*e), "{}: {e} listed twice", f.file);
        }
    }
    let all: Vec<&str> = FILES
        .iter()
        .flat_map(|f| f.entries.iter().copied())
        .collect();
    let unique: BTreeSet<&str> = all.iter().copied().collect();
    assert_eq!(all.len(), unique.len(), "an entry point is in two files");
}

#[test]
fn ptxas_report_parses() {
    let out = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'attn_fwd_bf16_d128' for 'sm_90'
ptxas info    : Function properties for attn_fwd_bf16_d128
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 64 bytes smem
ptxas info    : Compiling entry function 'cast_f32_to_bf16' for 'sm_90'
ptxas info    : Function properties for cast_f32_to_bf16
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 13 registers, used 0 barriers
";
    let m = parse_ptxas(out);
    assert_eq!(
        m["attn_fwd_bf16_d128"],
        Figures {
            registers: 128,
            spill_stores: 12,
            spill_loads: 16,
            stack: 8,
            smem: 64
        }
    );
    assert_eq!(m["cast_f32_to_bf16"].registers, 13);
    assert_eq!(m["cast_f32_to_bf16"].spill_loads, 0);
}
