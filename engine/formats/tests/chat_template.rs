//! Chat templates: ChatML and Llama 3 style templates render exactly as transformers would
//! (trim_blocks/lstrip_blocks, bos_token, strftime_now), Python string methods and HF's
//! `tojson` work, `raise_exception` messages and syntax errors surface as clear errors.

use baton_formats::{ChatMessage, ChatTemplate, FormatError};

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const LLAMA3: &str = r#"{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Conversation roles must be user or assistant, got " + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

fn msgs(list: &[(&str, &str)]) -> Vec<ChatMessage> {
    list.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect()
}

#[test]
fn chatml_renders_exactly() {
    let t = ChatTemplate::new(CHATML, "", "<|im_end|>").expect("compile");
    let m = msgs(&[("system", "Be brief."), ("user", "Hi 你好 😀"), ("assistant", "Hello!"), ("user", "Bye")]);
    let want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 你好 😀<|im_end|>\n\
<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n";
    assert_eq!(t.render(&m, false).expect("render"), want);
    assert_eq!(t.render(&m, true).expect("render"), format!("{want}<|im_start|>assistant\n"));
}

#[test]
fn llama3_style_template_renders_with_date_and_bos() {
    let t = ChatTemplate::new(LLAMA3, "<|begin_of_text|>", "<|eot_id|>").expect("compile");
    let before = chrono::Local::now().format("%d %b %Y").to_string();
    let out = t.render(&msgs(&[("system", "  You are helpful.  "), ("user", " What is 2+2? ")]), true).expect("render");
    let after = chrono::Local::now().format("%d %b %Y").to_string();
    let want = |date: &str| {
        format!(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nToday Date: {date}\n\n\
You are helpful.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>\
<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    };
    assert!(out == want(&before) || out == want(&after), "{out:?}");
}

#[test]
fn raise_exception_message_passes_through() {
    let t = ChatTemplate::new(LLAMA3, "<s>", "</s>").expect("compile");
    let err = t.render(&msgs(&[("tool", "x")]), false).expect_err("must raise");
    assert!(matches!(err, FormatError::Template { .. }));
    assert!(err.to_string().contains("Conversation roles must be user or assistant, got tool"), "{err}");
}

#[test]
fn syntax_errors_fail_at_construction() {
    let err = ChatTemplate::new("{% for m in messages %}{{ m.content }", "", "").expect_err("syntax");
    assert!(matches!(err, FormatError::Template { .. }), "{err}");
}

#[test]
fn trim_and_lstrip_blocks_match_transformers() {
    let src =
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
    let t = ChatTemplate::new(src, "", "").expect("compile");
    assert_eq!(t.render(&msgs(&[("user", "a"), ("bot", "b"), ("user", "c")]), false).expect("render"), "[a]\n[c]\n");
}

#[test]
fn python_methods_and_tojson_work() {
    let src = "{% for m in messages %}{{ m.content.strip().upper() }}|{{ m.role.startswith('us') }}|\
{{ m.content.split(',') | length }}|{{ m | tojson }}|{{ {'k': [1, 2]} | tojson(indent=2) }}\n{% endfor %}";
    let t = ChatTemplate::new(src, "", "").expect("compile");
    let out = t.render(&msgs(&[("user", " a,b <é> ")]), false).expect("render");
    assert_eq!(
        out,
        "A,B <É>|True|2|{\"content\": \" a,b <é> \", \"role\": \"user\"}|{\n  \"k\": [\n    1,\n    2\n  ]\n}\n"
    );
}

#[test]
fn tokenizer_config_list_form_picks_default() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let p = tmp.path().join("tokenizer_config.json");
    let cfg = serde_json::json!({
        "bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}]
    });
    std::fs::write(&p, cfg.to_string()).expect("write");
    let t = ChatTemplate::from_tokenizer_config(&p).expect("parse").expect("has template");
    assert_eq!(t.render(&msgs(&[("user", "x")]), false).expect("render"), "<s>x</s>");
    std::fs::write(&p, r#"{"eos_token": "</s>"}"#).expect("write");
    assert!(ChatTemplate::from_tokenizer_config(&p).expect("parse").is_none());
}

#[test]
fn separate_chat_template_jinja_file_is_used() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let p = tmp.path().join("tokenizer_config.json");
    std::fs::write(&p, r#"{"bos_token": "<s>", "eos_token": "</s>"}"#).expect("write");
    std::fs::write(tmp.path().join("chat_template.jinja"), "{% for m in messages %}[{{ m.role }}]{% endfor %}")
        .expect("write");
    let t = ChatTemplate::from_tokenizer_config(&p).expect("parse").expect("template");
    assert_eq!(t.render(&msgs(&[("user", "x"), ("assistant", "y")]), false).expect("render"), "[user][assistant]");
}

#[test]
fn extra_variables_reach_the_template() {
    let src = "{% if tools %}{% for t in tools %}<tool>{{ t.name }}</tool>{% endfor %}{% endif %}\
{% for m in messages %}{{ m.content }}{% endfor %}{{ bos_token }}";
    let t = ChatTemplate::new(src, "<s>", "</s>").expect("compile");
    let extra = serde_json::json!({"tools": [{"name": "search"}, {"name": "calc"}], "bos_token": "ignored"});
    let out = t.render_with(&msgs(&[("user", "hi")]), false, &extra).expect("render");
    assert_eq!(out, "<tool>search</tool><tool>calc</tool>hi<s>");
    assert_eq!(t.render(&msgs(&[("user", "hi")]), false).expect("render"), "hi<s>");
}
