//! Print the job spec (JSON) that `validate` builds for one published run.
//! `cargo run -p shardwright-validate --example dump_spec -- [RUNS_FILE] RUN_ID`
//! (default runs file: the bundled data/published-runs.json). With `--all` as the id, prints
//! every run's GPU kind, spec and notes (or its skip reason) to stdout, one block per run:
//! a diff of two such dumps shows exactly which runs a change to `setup` touched.
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (text, id) = match args.as_slice() {
        [id] => (shardwright_validate::BUNDLED_RUNS.to_string(), id.clone()),
        [file, id] => match std::fs::read_to_string(file) {
            Ok(t) => (t, id.clone()),
            Err(e) => {
                eprintln!("reading {file}: {e}");
                std::process::exit(1);
            }
        },
        _ => {
            eprintln!("usage: dump_spec [RUNS_FILE] RUN_ID");
            std::process::exit(2);
        }
    };
    let runs = match shardwright_validate::runs::load_runs(&text) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("runs file: {e}");
            std::process::exit(2);
        }
    };
    if id == "--all" {
        for run in &runs.runs {
            println!("== {}", run.id);
            match shardwright_validate::setup::setup_run_in(run, runs.hardware.as_ref()) {
                Ok(s) => {
                    println!("kind {} source {}", s.gpu_kind, s.source);
                    println!("{}", serde_json::to_string_pretty(&s.spec).unwrap());
                    for n in s.notes {
                        println!("note: {n}");
                    }
                }
                Err(e) => println!("skipped: {}", e.reason),
            }
        }
        return;
    }
    let Some(run) = runs.runs.iter().find(|r| r.id == id) else {
        eprintln!("no run `{id}`");
        std::process::exit(2);
    };
    match shardwright_validate::setup::setup_run_in(run, runs.hardware.as_ref()) {
        Ok(s) => {
            println!("{}", serde_json::to_string_pretty(&s.spec).unwrap());
            for n in s.notes {
                eprintln!("note: {n}");
            }
        }
        Err(e) => eprintln!("skipped: {e:?}"),
    }
}
