//! The request side of tool calling: `tools`, `tool_choice` and `parallel_tool_calls`
//! validated and resolved into how the output is read ([`ToolFormat`]), the grammar that
//! forces calls (`required`, a named function), and what the chat template receives.
//!
//! vLLM's rules: `tool_choice` defaults to `auto` when there are tools and `none` otherwise;
//! `auto` needs the server started with `--enable-auto-tool-choice` and a
//! `--tool-call-parser`; `required` constrains the output to a JSON list of
//! `{"name", "parameters"}` (at most one entry with `parallel_tool_calls: false`) and a named
//! function to that function's parameters. Every refusal names its field.

use super::{OutputParser, ReasoningParser, ToolCallParser, ToolFormat};
use crate::error::FrontendError;
use crate::pipeline::GrammarCheck;
use baton_core::structured::GrammarSpec;
use serde::Deserialize;
use serde_json::{Value, json};

/// Server-wide tool and reasoning options (`--enable-auto-tool-choice`, `--tool-call-parser`,
/// `--reasoning-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ToolConfig {
    /// Let the model decide to call tools (`tool_choice: "auto"`).
    pub enable_auto_tool_choice: bool,
    /// The format the served model writes calls in.
    pub tool_call_parser: Option<ToolCallParser>,
    /// Splits reasoning from the answer.
    pub reasoning_parser: Option<ReasoningParser>,
}

/// One entry of `tools`.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolIn {
    /// Must be `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: FunctionIn,
}

/// A function the model may call.
#[derive(Debug, Clone, Deserialize)]
pub struct FunctionIn {
    /// Its name, as the model writes it.
    pub name: String,
    /// What it does (for the template).
    pub description: Option<String>,
    /// JSON Schema of its arguments object.
    pub parameters: Option<Value>,
    /// OpenAI's strict mode; arguments are always schema-constrained when calls are forced.
    pub strict: Option<bool>,
}

/// `tool_choice`: a mode or a named function.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ToolChoiceIn {
    /// `none`, `auto` or `required`.
    Mode(String),
    /// `{"type": "function", "function": {"name": ...}}`.
    Named {
        /// Must be `function`.
        #[serde(rename = "type")]
        kind: String,
        /// Which function.
        function: NamedFunction,
    },
}

/// The function of a named `tool_choice`.
#[derive(Debug, Clone, Deserialize)]
pub struct NamedFunction {
    /// Must be one of `tools`.
    pub name: String,
}

/// A request's tools, resolved.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolSetup {
    /// `tools` as the chat template receives them (HF's shape: the OpenAI list).
    pub template_tools: Option<Value>,
    /// How the output's calls are read; `None`: not at all.
    pub format: Option<ToolFormat>,
    /// The grammar forcing calls (its checks come first, naming each tool's parameters).
    pub grammar: Option<GrammarSpec>,
    /// Grammars to compile first, each naming its field.
    pub checks: Vec<GrammarCheck>,
    /// `parallel_tool_calls: false`: at most one call.
    pub max_calls: Option<usize>,
}

impl ToolSetup {
    /// The output parser of a request with this setup. Reasoning is not parsed when a grammar
    /// constrains the output from its first token (`grammar_active`): the model cannot think
    /// first, and `deepseek_r1` would take the whole answer for reasoning.
    pub fn output_parser(&self, config: &ToolConfig, grammar_active: bool, thinking: bool) -> OutputParser {
        OutputParser {
            reasoning: config.reasoning_parser.filter(|_| !grammar_active && thinking),
            tools: self.format.clone(),
            max_calls: self.max_calls,
        }
    }
}

fn check_name(i: usize, name: &str) -> Result<(), FrontendError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        return Ok(());
    }
    Err(FrontendError::invalid(
        format!("tools[{i}].function.name"),
        format!("function names must be 1 to 64 characters of a-z, A-Z, 0-9, `_`, `-` or `.`, got {name:?}"),
    ))
}

/// The schema of a function's arguments (an open object when it declares none).
fn parameters_schema(f: &FunctionIn) -> Value {
    f.parameters.clone().unwrap_or_else(|| json!({"type": "object"}))
}

/// Validates and resolves a request's tool fields.
pub fn resolve(
    tools: Option<Vec<ToolIn>>,
    choice: Option<ToolChoiceIn>,
    parallel_tool_calls: Option<bool>,
    config: &ToolConfig,
) -> Result<ToolSetup, FrontendError> {
    let tools = tools.unwrap_or_default();
    for (i, tool) in tools.iter().enumerate() {
        if tool.kind != "function" {
            return Err(FrontendError::invalid(
                format!("tools[{i}].type"),
                format!("only tools of type `function` are supported, got `{}`", tool.kind),
            ));
        }
        check_name(i, &tool.function.name)?;
        if tools[..i].iter().any(|t| t.function.name == tool.function.name) {
            return Err(FrontendError::invalid(
                format!("tools[{i}].function.name"),
                format!("the function name `{}` appears twice in `tools`", tool.function.name),
            ));
        }
        if let Some(p) = &tool.function.parameters
            && !p.is_object()
        {
            return Err(FrontendError::invalid(
                format!("tools[{i}].function.parameters"),
                "function parameters must be a JSON Schema object",
            ));
        }
    }
    let max_calls = (parallel_tool_calls == Some(false)).then_some(1);
    let no_tools = |what: &str| {
        FrontendError::invalid("tool_choice", format!("tool_choice `{what}` needs a non-empty `tools` list"))
    };
    let mut setup = ToolSetup { max_calls, ..Default::default() };
    let mode = match &choice {
        None if tools.is_empty() => "none",
        None => "auto",
        Some(ToolChoiceIn::Mode(m)) => m.as_str(),
        Some(ToolChoiceIn::Named { kind, function }) => {
            if kind != "function" {
                return Err(FrontendError::invalid(
                    "tool_choice",
                    format!("a named tool_choice must have type `function`, got `{kind}`"),
                ));
            }
            let Some((i, tool)) = tools.iter().enumerate().find(|(_, t)| t.function.name == function.name) else {
                return Err(FrontendError::invalid(
                    "tool_choice",
                    format!("tool_choice names the function `{}`, which is not in `tools`", function.name),
                ));
            };
            let spec = GrammarSpec::JsonSchema(parameters_schema(&tool.function).to_string());
            setup.checks.push(GrammarCheck { param: format!("tools[{i}].function.parameters"), spec: spec.clone() });
            setup.grammar = Some(spec);
            setup.format = Some(ToolFormat::Named(function.name.clone()));
            setup.template_tools = Some(template_tools(&tools));
            return Ok(setup);
        }
    };
    match mode {
        "none" => {
            // The template still sees the tools (vLLM passes them unless
            // `--exclude-tools-when-tool-choice-none`); nothing is parsed.
            setup.template_tools = (!tools.is_empty()).then(|| template_tools(&tools));
        }
        "auto" => {
            if tools.is_empty() {
                return Err(no_tools("auto"));
            }
            let parser = match (config.enable_auto_tool_choice, config.tool_call_parser) {
                (true, Some(p)) => p,
                _ => {
                    return Err(FrontendError::invalid(
                        "tool_choice",
                        "tool_choice \"auto\" (the default with tools) requires the server to be started with \
                         --enable-auto-tool-choice and --tool-call-parser; send tool_choice \"required\" or a named \
                         function instead",
                    ));
                }
            };
            setup.format = Some(ToolFormat::Auto(parser));
            setup.template_tools = Some(template_tools(&tools));
        }
        "required" => {
            if tools.is_empty() {
                return Err(no_tools("required"));
            }
            let mut alternatives = Vec::with_capacity(tools.len());
            for (i, tool) in tools.iter().enumerate() {
                let params = parameters_schema(&tool.function);
                setup.checks.push(GrammarCheck {
                    param: format!("tools[{i}].function.parameters"),
                    spec: GrammarSpec::JsonSchema(params.to_string()),
                });
                alternatives.push(json!({
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
                    "required": ["name", "parameters"],
                    "additionalProperties": false,
                }));
            }
            let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": alternatives}});
            if max_calls.is_some() {
                schema["maxItems"] = json!(1);
            }
            let spec = GrammarSpec::JsonSchema(schema.to_string());
            setup.checks.push(GrammarCheck { param: "tool_choice".into(), spec: spec.clone() });
            setup.grammar = Some(spec);
            setup.format = Some(ToolFormat::Required);
            setup.template_tools = Some(template_tools(&tools));
        }
        other => {
            return Err(FrontendError::invalid(
                "tool_choice",
                format!("tool_choice must be `none`, `auto`, `required` or a named function, got `{other}`"),
            ));
        }
    }
    Ok(setup)
}

/// `tools` in the shape HF chat templates read (`tool.function.name`, ...).
fn template_tools(tools: &[ToolIn]) -> Value {
    Value::Array(
        tools
            .iter()
            .map(|t| {
                let mut function = json!({"name": t.function.name, "parameters": parameters_schema(&t.function)});
                if let Some(d) = &t.function.description {
                    function["description"] = json!(d);
                }
                json!({"type": "function", "function": function})
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(v: Value) -> Option<Vec<ToolIn>> {
        Some(serde_json::from_value(v).expect("tools"))
    }

    fn choice(v: Value) -> Option<ToolChoiceIn> {
        Some(serde_json::from_value(v).expect("tool_choice"))
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "description": "d",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}}])
    }

    #[test]
    fn modes_resolve_to_formats_and_grammars() {
        let auto = ToolConfig {
            enable_auto_tool_choice: true,
            tool_call_parser: Some(ToolCallParser::Hermes),
            ..Default::default()
        };
        let s = resolve(tools(weather()), None, None, &auto).expect("auto");
        assert_eq!(s.format, Some(ToolFormat::Auto(ToolCallParser::Hermes)));
        assert!(s.grammar.is_none() && s.checks.is_empty());
        assert_eq!(s.template_tools.as_ref().expect("tools")[1]["function"]["parameters"], json!({"type": "object"}));

        let s = resolve(tools(weather()), choice(json!("required")), Some(false), &ToolConfig::default())
            .expect("required");
        assert_eq!(s.format, Some(ToolFormat::Required));
        assert_eq!(s.max_calls, Some(1));
        let params: Vec<&str> = s.checks.iter().map(|c| c.param.as_str()).collect();
        assert_eq!(params, ["tools[0].function.parameters", "tools[1].function.parameters", "tool_choice"]);
        let Some(GrammarSpec::JsonSchema(schema)) = &s.grammar else { panic!("schema") };
        let schema: Value = serde_json::from_str(schema).expect("json");
        assert_eq!((schema["minItems"].clone(), schema["maxItems"].clone()), (json!(1), json!(1)));
        assert_eq!(schema["items"]["anyOf"][0]["properties"]["name"]["enum"], json!(["get_weather"]));

        let named = choice(json!({"type": "function", "function": {"name": "get_weather"}}));
        let s = resolve(tools(weather()), named, None, &ToolConfig::default()).expect("named");
        assert_eq!(s.format, Some(ToolFormat::Named("get_weather".into())));
        assert_eq!(s.checks[0].param, "tools[0].function.parameters");

        let s = resolve(tools(weather()), choice(json!("none")), None, &ToolConfig::default()).expect("none");
        assert!(s.format.is_none() && s.grammar.is_none() && s.template_tools.is_some());
        let s = resolve(None, None, Some(true), &ToolConfig::default()).expect("nothing");
        assert!(s.format.is_none() && s.template_tools.is_none());
    }

    #[test]
    fn refusals_name_their_field() {
        let off = ToolConfig::default();
        let cases = [
            (tools(weather()), None, "tool_choice", "--enable-auto-tool-choice"),
            (tools(weather()), choice(json!("sometimes")), "tool_choice", "sometimes"),
            (
                tools(weather()),
                choice(json!({"type": "function", "function": {"name": "nope"}})),
                "tool_choice",
                "not in `tools`",
            ),
            (None, choice(json!("required")), "tool_choice", "non-empty"),
            (tools(json!([{"type": "retrieval", "function": {"name": "a"}}])), None, "tools[0].type", "function"),
            (tools(json!([{"type": "function", "function": {"name": "a b"}}])), None, "tools[0].function.name", "a b"),
            (
                tools(
                    json!([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]),
                ),
                None,
                "tools[1].function.name",
                "twice",
            ),
            (
                tools(json!([{"type": "function", "function": {"name": "a", "parameters": [1]}}])),
                None,
                "tools[0].function.parameters",
                "JSON Schema",
            ),
        ];
        for (t, c, param, words) in cases {
            let e = resolve(t, c, None, &off).expect_err(param);
            assert_eq!(e.param(), Some(param), "{e}");
            assert!(e.to_string().contains(words), "{e}");
        }
    }
}
