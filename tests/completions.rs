//! `shardwright completions SHELL`: the scripts name every subcommand that `--help` lists
//! and the flags of `launch`; the bash script parses (`bash -n`).

use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shardwright"))
}

/// Subcommand names from `shardwright --help` (the "Commands:" block).
fn subcommands() -> Vec<String> {
    let out = bin().arg("--help").output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let block = text.split("Commands:").nth(1).expect("a Commands: block");
    let names: Vec<String> = block
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|n| n != "help")
        .collect();
    assert!(names.len() >= 10, "{names:?}");
    names
}

#[test]
fn every_shell_script_names_every_subcommand() {
    let subs = subcommands();
    assert!(subs.iter().any(|s| s == "completions"));
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = bin().args(["completions", shell]).output().unwrap();
        assert!(out.status.success(), "{shell}: {out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        for s in &subs {
            assert!(text.contains(s.as_str()), "{shell}: subcommand {s} missing");
        }
        for flag in ["local", "slurm", "timeout"] {
            assert!(text.contains(flag), "{shell}: launch's --{flag} missing");
        }
    }
}

#[test]
fn the_bash_script_parses() {
    let out = bin().args(["completions", "bash"]).output().unwrap();
    let path = std::env::temp_dir().join(format!(
        "shardwright-completion-{}.bash",
        std::process::id()
    ));
    std::fs::write(&path, &out.stdout).unwrap();
    let st = Command::new("bash").arg("-n").arg(&path).status();
    let _ = std::fs::remove_file(&path);
    match st {
        Ok(st) => assert!(st.success(), "bash -n rejects the script"),
        Err(e) => eprintln!("bash not available ({e}); skipped the syntax check"),
    }
}

#[test]
fn an_unknown_shell_is_a_usage_error() {
    let out = bin().args(["completions", "tcsh"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("'tcsh'") && err.contains("bash"), "{err}");
}
