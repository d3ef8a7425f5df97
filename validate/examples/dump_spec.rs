//! Print the job spec (JSON) that `validate` builds for one published run.
//! `cargo run -p shardwright-validate --example dump_spec -- RUNS_FILE RUN_ID`
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(file), Some(id)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: dump_spec RUNS_FILE RUN_ID");
        std::process::exit(2);
    };
    let text = std::fs::read_to_string(file).expect("read runs file");
    let runs = shardwright_validate::runs::load_runs(&text).expect("parse runs file");
    let Some(run) = runs.runs.iter().find(|r| &r.id == id) else {
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
