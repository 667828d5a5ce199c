//! Parsers on recorded model outputs in each family's format; the streaming form fed each
//! output split at every character boundary (and one character at a time) must add up to
//! exactly the whole-text result.

use super::*;

fn call(name: &str, arguments: &str) -> ParsedCall {
    ParsedCall { name: name.into(), arguments: arguments.into() }
}

fn out(reasoning: &str, content: &str, calls: Vec<ParsedCall>) -> ParsedOutput {
    ParsedOutput { reasoning: reasoning.into(), content: content.into(), calls }
}

/// Adds up stream deltas the way a client does.
fn apply(acc: &mut ParsedOutput, delta: OutputDelta) {
    acc.reasoning.push_str(&delta.reasoning);
    acc.content.push_str(&delta.content);
    for c in delta.calls {
        if let Some(name) = c.name {
            assert_eq!(c.index, acc.calls.len(), "calls start in order");
            acc.calls.push(ParsedCall { name, arguments: String::new() });
        }
        acc.calls[c.index].arguments.push_str(&c.arguments);
    }
}

fn streamed(parser: &OutputParser, pieces: &[&str]) -> ParsedOutput {
    let mut s = StreamingParser::new(parser.clone());
    let mut acc = ParsedOutput::default();
    for p in pieces {
        apply(&mut acc, s.push(p));
    }
    apply(&mut acc, s.finish());
    acc
}

/// The whole-text result is `expected`, and so is every way of streaming it.
fn check(parser: &OutputParser, text: &str, expected: &ParsedOutput) {
    assert_eq!(&parser.parse(text, true), expected, "whole text {text:?}");
    for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
        let got = streamed(parser, &[&text[..cut], &text[cut..]]);
        assert_eq!(&got, expected, "{text:?} split at {cut}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(&streamed(parser, &pieces), expected, "{text:?} char by char");
}

fn auto(p: ToolCallParser) -> OutputParser {
    OutputParser { tools: Some(ToolFormat::Auto(p)), ..Default::default() }
}

#[test]
fn hermes_recorded_outputs() {
    let p = auto(ToolCallParser::Hermes);
    // Qwen2.5-7B-Instruct, two parallel calls.
    let text = "<tool_call>\n{\"name\": \"get_current_temperature\", \"arguments\": {\"location\": \"San Francisco, CA, USA\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_temperature_date\", \"arguments\": {\"location\": \"San Francisco, CA, USA\", \"date\": \"2024-10-01\"}}\n</tool_call>";
    check(
        &p,
        text,
        &out(
            "",
            "",
            vec![
                call("get_current_temperature", r#"{"location": "San Francisco, CA, USA"}"#),
                call("get_temperature_date", r#"{"location": "San Francisco, CA, USA", "date": "2024-10-01"}"#),
            ],
        ),
    );
    // Content before a call, arguments before the name, unicode.
    let text = "Sure — checking.\n\n<tool_call>\n{\"arguments\": {\"q\": \"caf\u{e9} \\\"x\\\"\"}, \"name\": \"search\"}\n</tool_call>\n";
    check(&p, text, &out("", "Sure — checking.", vec![call("search", r#"{"q": "café \"x\""}"#)]));
    // No call: content as is, a lone `<` included.
    check(&p, "a < b, and 2<3 \n", &out("", "a < b, and 2<3 \n", vec![]));
    // A block that is not a call stays content; a truncated call keeps what was written.
    check(&p, "x <tool_call>oops</tool_call> y", &out("", "x <tool_call>oops</tool_call> y", vec![]));
    check(
        &p,
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2",
        &out("", "", vec![call("f", "{\"a\": [1, 2")]),
    );
    check(&p, "<tool_call>{\"name\": \"f\"}</tool_call>", &out("", "", vec![call("f", "{}")]));
}

#[test]
fn llama3_json_recorded_outputs() {
    let p = auto(ToolCallParser::Llama3Json);
    let text = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}";
    check(&p, text, &out("", "", vec![call("get_weather", r#"{"city": "Paris", "unit": "celsius"}"#)]));
    let text = "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}}";
    check(&p, text, &out("", "", vec![call("a", "{}"), call("b", r#"{"x": 1}"#)]));
    check(&p, "The capital is Paris.", &out("", "The capital is Paris.", vec![]));
    // JSON that is not a call is content.
    check(&p, "{\"answer\": 42}", &out("", "{\"answer\": 42}", vec![]));
}

#[test]
fn mistral_recorded_outputs() {
    let p = auto(ToolCallParser::Mistral);
    let text = "[TOOL_CALLS][{\"name\": \"get_current_weather\", \"arguments\": {\"location\": \"Dallas\", \"unit\": \"fahrenheit\"}}, {\"name\": \"t\", \"arguments\": {}}]";
    check(
        &p,
        text,
        &out(
            "",
            "",
            vec![call("get_current_weather", r#"{"location": "Dallas", "unit": "fahrenheit"}"#), call("t", "{}")],
        ),
    );
    let text = "Let me look.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[ARGS]{}";
    check(
        &p,
        text,
        &out("", "Let me look.", vec![call("get_weather", r#"{"city": "Paris"}"#), call("get_time", "{}")]),
    );
    check(&p, "[TOOL_CALLS]add{\"a\": 1, \"b\": 2}", &out("", "", vec![call("add", r#"{"a": 1, "b": 2}"#)]));
    check(&p, "No tools [here].", &out("", "No tools [here].", vec![]));
}

#[test]
fn pythonic_recorded_outputs() {
    let p = auto(ToolCallParser::Pythonic);
    let text = "[get_weather(city='San Francisco', metric=\"celsius\"), get_time(zone='PST', exact=True, n=-3, f=1.5, xs=[1, None], d={'k': (1, 2)})]";
    check(
        &p,
        text,
        &out(
            "",
            "",
            vec![
                call("get_weather", r#"{"city":"San Francisco","metric":"celsius"}"#),
                call("get_time", r#"{"zone":"PST","exact":true,"n":-3,"f":1.5,"xs":[1,null],"d":{"k":[1,2]}}"#),
            ],
        ),
    );
    check(&p, "<|python_start|>[noop()]<|python_end|>", &out("", "", vec![call("noop", "{}")]));
    check(&p, "Plain answer.", &out("", "Plain answer.", vec![]));
    check(&p, "[1, 2, 3]", &out("", "[1, 2, 3]", vec![]));
    check(&p, "[f(a='it\\'s')] done", &out("", "done", vec![call("f", r#"{"a":"it's"}"#)]));
}

#[test]
fn harmony_recorded_outputs() {
    let p = auto(ToolCallParser::Openai);
    let text = "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"San Francisco\"}<|call|>";
    check(
        &p,
        text,
        &out("Need to use function get_weather.", "", vec![call("get_weather", r#"{"location":"San Francisco"}"#)]),
    );
    let text = "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!";
    check(&p, text, &out("Simple.", "Hello there!", vec![]));
    check(&p, "not harmony", &out("", "not harmony", vec![]));
}

#[test]
fn reasoning_parsers_split_thinking() {
    let qwen = OutputParser { reasoning: Some(ReasoningParser::Qwen3), ..Default::default() };
    check(&qwen, "<think>\nHmm, 2+2.\n</think>\n\nIt is 4.", &out("Hmm, 2+2.\n", "It is 4.", vec![]));
    check(&qwen, "It is 4.", &out("", "It is 4.", vec![]));
    check(&qwen, "<think>cut off", &out("cut off", "", vec![]));
    let r1 = OutputParser { reasoning: Some(ReasoningParser::DeepseekR1), ..Default::default() };
    check(&r1, "Let me think.</think>Answer", &out("Let me think.", "Answer", vec![]));
    check(&r1, "<think>a</think>b", &out("a", "b", vec![]));
    check(&r1, "never closed", &out("never closed", "", vec![]));
    // Tool parsing applies to what follows the reasoning.
    let both = OutputParser {
        reasoning: Some(ReasoningParser::Qwen3),
        tools: Some(ToolFormat::Auto(ToolCallParser::Hermes)),
        max_calls: None,
    };
    check(
        &both,
        "<think>\nuse the tool\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        &out("use the tool\n", "", vec![call("f", "{}")]),
    );
}

#[test]
fn forced_calls_and_the_parallel_cap() {
    let required = OutputParser { tools: Some(ToolFormat::Required), ..Default::default() };
    let text = r#"[{"name": "a", "parameters": {"x": [1, {"y": "}"}]}}, {"name": "b", "parameters": {}}]"#;
    check(&required, text, &out("", "", vec![call("a", r#"{"x": [1, {"y": "}"}]}"#), call("b", "{}")]));
    let one = OutputParser { max_calls: Some(1), ..required };
    check(&one, text, &out("", "", vec![call("a", r#"{"x": [1, {"y": "}"}]}"#)]));
    let named = OutputParser { tools: Some(ToolFormat::Named("f".into())), ..Default::default() };
    check(&named, " {\"a\": 1} \n", &out("", "", vec![call("f", r#"{"a": 1}"#)]));
}

#[test]
fn parser_names_round_trip_and_unknown_ones_list_the_choices() {
    for (name, p) in ToolCallParser::ALL {
        assert_eq!(name.parse::<ToolCallParser>().expect("known"), *p);
        assert_eq!(p.to_string(), *name);
    }
    let e = "nope".parse::<ToolCallParser>().expect_err("unknown");
    assert!(e.contains("hermes") && e.contains("pythonic") && e.contains("openai"), "{e}");
    assert_eq!("deepseek_r1".parse::<ReasoningParser>(), Ok(ReasoningParser::DeepseekR1));
    assert!("x".parse::<ReasoningParser>().expect_err("unknown").contains("qwen3"));
}
