//! Print the job spec (JSON) that `validate` builds for one published run.
//! `cargo run -p shardwright-validate --example dump_spec -- [RUNS_FILE] RUN_ID`
//! (default runs file: the bundled data/published-runs.json).
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
    let Some(run) = runs.runs.iter().find(|r| r.id == id) else {
        eprintln!("no run `{id}`");
        std::process::exit(2);
    };
    match shardwright_validate::setup::setup_run(run) {
        Ok(s) => {
            println!("{}", serde_json::to_string_pretty(&s.spec).unwrap());
            for n in s.notes {
                eprintln!("note: {n}");
            }
        }
        Err(e) => eprintln!("skipped: {e:?}"),
    }
}
