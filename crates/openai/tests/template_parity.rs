//! Parity with Python: the frontend must render chat templates and tokenize exactly as an
//! engine does with transformers' jinja2 environment and the `tokenizers` package, or the
//! router's block hashes will not match what the engine caches.
//!
//! tests/engines/make_model_dir.py builds a model directory with Python's `tokenizers`, then
//! prints Python's renderings and ids; this test demands the same bytes and ids from the
//! Rust side. It needs python3 with `tokenizers` and `jinja2` (scripts/setup.sh installs them
//! into .tools/py); without them it fails rather than skips.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvrouter_openai::{ChatInput, ChatTemplateError, ModelDirError, ModelFiles, PromptLimitSource};
use serde_json::{json, Value};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn script() -> PathBuf {
    workspace_root().join("tests/engines/make_model_dir.py")
}

/// python3 with .tools/py ahead of any PYTHONPATH, as scripts/setup.sh arranges.
fn python() -> Command {
    let mut path = workspace_root().join(".tools/py").into_os_string();
    if let Some(existing) = std::env::var_os("PYTHONPATH") {
        path.push(":");
        path.push(existing);
    }
    let mut cmd = Command::new("python3");
    cmd.env("PYTHONPATH", path);
    cmd
}

fn run_python(args: &[&str]) -> Vec<u8> {
    let check = python()
        .args(["-c", "import tokenizers, jinja2"])
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run python3 ({e}); the parity test needs python3 on PATH")
        });
    assert!(
        check.status.success(),
        "python3 lacks the `tokenizers` and `jinja2` packages needed for the parity test; run \
         `. scripts/setup.sh` (installs them into .tools/py). python3 said: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    let out = python()
        .arg(script())
        .args(args)
        .output()
        .expect("run make_model_dir.py");
    assert!(
        out.status.success(),
        "make_model_dir.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn build_model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    run_python(&["build", dir.path().to_str().unwrap()]);
    dir
}

/// Weather tool with its keys in sorted order: the frontend's serde_json maps sort keys,
/// while Python keeps the client's order, so `tojson` output agrees only for sorted input.
fn tools() -> Value {
    json!([{
        "function": {
            "description": "Weather <now> & \"quoted\" café\n",
            "name": "get_weather",
            "parameters": {
                "properties": {"city": {"type": "string"}, "days": {"maximum": 7.5, "type": "integer"}},
                "required": ["city"],
                "type": "object"
            }
        },
        "type": "function"
    }])
}

fn chat_cases() -> Vec<Value> {
    vec![
        // System message, multi-turn, content parts (non-text parts skipped), tools.
        json!({"messages": [
            {"role": "system", "content": "  Be brief.  \n"},
            {"role": "user", "content": "Hi  "},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": [
                {"type": "text", "text": " part one "},
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                {"type": "text", "text": "part two"}
            ]}
        ], "add_generation_prompt": true, "tools": tools()}),
        // The same without the generation prompt and without tools.
        json!({"messages": [
            {"role": "system", "content": "  Be brief.  \n"},
            {"role": "user", "content": "Hi  "},
            {"role": "assistant", "content": "Hello!"}
        ], "add_generation_prompt": false}),
        // Tool calls with null content (Python prints None), tool results.
        json!({"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"function": {"arguments": "{\"city\": \"Paris\"}", "name": "get_weather"}, "id": "c1", "type": "function"}
            ]},
            {"role": "tool", "content": "sunny, 21°C"}
        ], "add_generation_prompt": true}),
        // No system message; whitespace to strip on every side.
        json!({"messages": [{"role": "user", "content": "\n\n  Hello\tthere  \t\n"}], "add_generation_prompt": true}),
        json!({"messages": [{"role": "user", "content": "plain"}], "add_generation_prompt": false}),
        // Unicode, quotes and template-looking text that must stay literal.
        json!({"messages": [
            {"role": "user", "content": "Привет 東京 🚀 café 'single' \"double\" {{ not_a_var }} {% raw %}"},
            {"role": "assistant", "content": "  ok  "},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "sure"},
            {"role": "user", "content": "third"}
        ], "add_generation_prompt": true}),
        // A role the template rejects through raise_exception.
        json!({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}),
        // Templates in the style of served models (loaded as --chat-template overrides).
        json!({"template": "qwen2.5", "add_generation_prompt": true, "tools": tools(), "messages": [
            {"role": "system", "content": "You route requests."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"arguments": "{\"city\": \"Paris\"}", "name": "get_weather"}, "id": "a", "type": "function"},
                {"function": {"arguments": "{\"city\": \"Rome\"}", "name": "get_weather"}, "id": "b", "type": "function"}
            ]},
            {"role": "tool", "content": "sunny"},
            {"role": "tool", "content": "rainy"},
            {"role": "assistant", "content": "Paris is sunny, Rome rainy."},
            {"role": "user", "content": "Thanks!"}
        ]}),
        json!({"template": "qwen2.5", "add_generation_prompt": false, "messages": [
            {"role": "user", "content": "no tools, default system"},
            {"role": "assistant", "content": "fine"}
        ]}),
        json!({"template": "llama3", "add_generation_prompt": true, "messages": [
            {"role": "system", "content": "  trimmed system \n"},
            {"role": "user", "content": "\tHello  "}
        ]}),
        json!({"template": "mistral", "messages": [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"}
        ]}),
        json!({"template": "mistral", "messages": [
            {"role": "user", "content": "one"},
            {"role": "user", "content": "two"}
        ]}),
    ]
}

fn texts() -> Vec<&'static str> {
    vec![
        "hello world",
        "",
        " leading and trailing spaces ",
        "café 東京 🚀 Привет",
        "cafe\u{301} decomposed (NFC makes it café)",
        "<|im_start|>user\nhi<|im_end|>",
        "</s><s>inner special tokens",
        "\t\ttabs\r\nand\nnewlines\n\n",
        // Longer than the truncation (16) left in tokenizer.json: must not be cut.
        "The quick brown fox jumps over the lazy dog. A KV cache keeps the attention keys \
         and values of recent prompts; routers send each request to the worker that holds it.",
    ]
}

const STRFTIME_FORMATS: [&str; 4] = [
    "%d %b %Y",
    "%-d %B %Y",
    "%Y-%m-%dT%H:%M:%S %a %A %j %p %I %y %e %U %W %w %u %%",
    "%c | %x | %X | %F %T %D %R %C %h",
];

struct Reference {
    chats: Vec<Value>,
    encodings: Vec<Value>,
    strftime: Vec<String>,
}

fn python_reference(dir: &Path, unix_seconds: i64) -> Reference {
    let cases = json!({
        "chats": chat_cases(),
        "texts": texts(),
        "strftime": {"unix_seconds": unix_seconds, "formats": STRFTIME_FORMATS},
    });
    let cases_path = dir.join("cases.json");
    std::fs::write(&cases_path, cases.to_string()).unwrap();
    let out = run_python(&[
        "reference",
        dir.to_str().unwrap(),
        cases_path.to_str().unwrap(),
    ]);
    let mut v: Value = serde_json::from_slice(&out).expect("reference output is JSON");
    let take = |v: &mut Value, k: &str| v[k].take().as_array().cloned().unwrap();
    Reference {
        chats: take(&mut v, "chats"),
        encodings: take(&mut v, "encodings"),
        strftime: take(&mut v, "strftime")
            .into_iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect(),
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn rust_matches_python_jinja2_and_tokenizers() {
    let dir = build_model_dir();
    let reference = python_reference(dir.path(), 1_709_211_909);
    let model = ModelFiles::load("parity", dir.path(), None, None).expect("load model dir");
    let tokenizer = model.tokenizer();
    let with_template = |name: &str| {
        let path = dir.path().join(format!("templates/{name}.jinja"));
        ModelFiles::load("parity", dir.path(), Some(&path), None).expect("load with override")
    };

    let cases = chat_cases();
    assert_eq!(reference.chats.len(), cases.len());
    let mut raised = 0;
    for (i, (case, expected)) in cases.iter().zip(&reference.chats).enumerate() {
        let messages = case["messages"].as_array().unwrap();
        let tools = case.get("tools").and_then(Value::as_array);
        let mut input = ChatInput::new(
            messages,
            case["add_generation_prompt"].as_bool().unwrap_or(false),
        );
        input.tools = tools.map(Vec::as_slice);
        let rendered = match case.get("template").and_then(Value::as_str) {
            Some(name) => with_template(name).render_chat(&input),
            None => model.render_chat(&input),
        };
        if let Some(text) = expected.get("ok") {
            let text = text.as_str().unwrap();
            let rendered = rendered.unwrap_or_else(|e| panic!("case {i}: Rust failed: {e}"));
            assert_eq!(rendered, text, "case {i}: rendering differs from jinja2");
            assert_eq!(
                tokenizer.encode(&rendered, false).unwrap(),
                ids(&expected["ids"]),
                "case {i}: chat prompt ids differ"
            );
        } else {
            let message = expected["error"].as_str().unwrap();
            match rendered {
                Err(ChatTemplateError::Raised(m)) => assert_eq!(m, message, "case {i}"),
                other => panic!("case {i}: expected raise_exception({message:?}), got {other:?}"),
            }
            raised += 1;
        }
    }
    assert_eq!(raised, 2, "exactly two cases raise");
    // The first cases really exercise the features they claim to.
    let first = reference.chats[0]["ok"].as_str().unwrap();
    assert!(
        first.starts_with("<s><|im_start|>system\nBe brief.\n# Tools\n{\"function\": {"),
        "{first}"
    );
    assert!(reference.chats[2]["ok"]
        .as_str()
        .unwrap()
        .contains("\nNone\n"));

    let texts = texts();
    assert_eq!(reference.encodings.len(), texts.len());
    for (text, expected) in texts.iter().zip(&reference.encodings) {
        assert_eq!(expected["text"].as_str().unwrap(), *text);
        let with = tokenizer.encode(text, true).unwrap();
        let without = tokenizer.encode(text, false).unwrap();
        assert_eq!(
            with,
            ids(&expected["with_special"]),
            "ids with special tokens for {text:?}"
        );
        assert_eq!(
            without,
            ids(&expected["without_special"]),
            "ids without special tokens for {text:?}"
        );
    }
    // add_special_tokens prepends <s> (the post-processor), and the long text is not cut.
    let bos = tokenizer.token_to_id("<s>").unwrap();
    let hello = tokenizer.encode("hello world", true).unwrap();
    assert_eq!(hello[0], bos);
    assert_eq!(&hello[1..], tokenizer.encode("hello world", false).unwrap());
    assert!(
        tokenizer
            .encode(texts.last().unwrap(), false)
            .unwrap()
            .len()
            > 16
    );
    assert_eq!(
        tokenizer
            .decode(&tokenizer.encode("café 東京 🚀", false).unwrap())
            .unwrap(),
        "café 東京 🚀"
    );

    let rust_stamps: Vec<String> = STRFTIME_FORMATS
        .iter()
        .map(|f| kvrouter_openai::chat_template::strftime_utc(f, 1_709_211_909))
        .collect();
    assert_eq!(
        rust_stamps, reference.strftime,
        "strftime differs from Python"
    );
}

#[test]
fn prompt_limit_resolution_order_on_a_real_model_dir() {
    let dir = build_model_dir();
    let p = dir.path();

    // tokenizer_config.json carries transformers' 1e30 sentinel: config.json decides.
    let model = ModelFiles::load("m", p, None, None).unwrap();
    assert_eq!(model.prompt_limit().tokens, 4096);
    assert_eq!(
        model.prompt_limit().source,
        PromptLimitSource::MaxPositionEmbeddings
    );

    // The override beats everything.
    let model = ModelFiles::load("m", p, None, Some(1000)).unwrap();
    assert_eq!(model.prompt_limit().tokens, 1000);
    assert_eq!(model.prompt_limit().source, PromptLimitSource::Override);

    // A real model_max_length beats max_position_embeddings.
    let config_path = p.join("tokenizer_config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    config["model_max_length"] = json!(2048);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let model = ModelFiles::load("m", p, None, None).unwrap();
    assert_eq!(model.prompt_limit().tokens, 2048);
    assert_eq!(
        model.prompt_limit().source,
        PromptLimitSource::ModelMaxLength
    );

    // No source left: a load error naming them all.
    config["model_max_length"] = json!(1e30);
    std::fs::write(&config_path, config.to_string()).unwrap();
    std::fs::remove_file(p.join("config.json")).unwrap();
    let err = ModelFiles::load("m", p, None, None).unwrap_err();
    assert!(matches!(err, ModelDirError::NoPromptLimit { .. }), "{err}");

    // The override template replaces the directory's.
    let over = p.join("override.jinja");
    std::fs::write(&over, "{% for m in messages %}[{{ m.role }}]{% endfor %}\n").unwrap();
    let model = ModelFiles::load("m", p, Some(&over), Some(10)).unwrap();
    let msgs = vec![json!({"role": "user", "content": "x"})];
    assert_eq!(
        model.render_chat(&ChatInput::new(&msgs, true)).unwrap(),
        "[user]"
    );
}
