//! Structured outputs at the OpenAI edge: `response_format` (OpenAI), the `guided_*` fields
//! (vLLM, older) and `structured_outputs` (vLLM, current) mapped onto one
//! [`GrammarSpec`] and the field the client used, so that a bad schema is a 400 naming it.
//!
//! At most one constraint per request. `guided_whitespace_pattern`,
//! `guided_decoding_backend` and `structured_outputs` options other than the grammar itself
//! are not honoured and are refused (the field audit for the former, here for the latter).

use super::protocol::StructuredFields;
use crate::error::FrontendError;
use crate::pipeline::GrammarCheck;
use baton_core::structured::GrammarSpec;
use serde_json::Value;

/// The keys of `structured_outputs` that carry a grammar; any other non-null key is refused.
const STRUCTURED_OUTPUT_KEYS: &[&str] = &["json", "regex", "choice", "grammar", "json_object"];

fn json_schema(param: &str, value: &Value) -> Result<GrammarSpec, FrontendError> {
    match value {
        Value::Object(_) | Value::Bool(_) => Ok(GrammarSpec::JsonSchema(value.to_string())),
        // vLLM accepts the schema as a JSON string too.
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => Ok(GrammarSpec::JsonSchema(v.to_string())),
            _ => Err(FrontendError::invalid(param, format!("{param} must be a JSON Schema (an object), got {s:?}"))),
        },
        other => Err(FrontendError::invalid(param, format!("{param} must be a JSON Schema object, got {other}"))),
    }
}

fn string(param: &str, value: &Value) -> Result<String, FrontendError> {
    value.as_str().map(str::to_owned).ok_or_else(|| FrontendError::invalid(param, format!("{param} must be a string")))
}

fn choices(param: &str, value: &Value) -> Result<GrammarSpec, FrontendError> {
    let list =
        value.as_array().and_then(|a| a.iter().map(|c| c.as_str().map(str::to_owned)).collect::<Option<Vec<_>>>());
    match list {
        Some(list) if !list.is_empty() => Ok(GrammarSpec::Choice(list)),
        _ => Err(FrontendError::invalid(param, format!("{param} must be a non-empty list of strings"))),
    }
}

fn response_format(value: &Value) -> Result<Option<GrammarSpec>, FrontendError> {
    const P: &str = "response_format";
    let kind = value.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            let Some(inner) = value.get("json_schema").filter(|v| v.is_object()) else {
                return Err(FrontendError::invalid(
                    "response_format.json_schema",
                    "response_format of type `json_schema` needs a `json_schema` object with a `schema`",
                ));
            };
            match inner.get("schema") {
                Some(schema) if !schema.is_null() => {
                    json_schema("response_format.json_schema.schema", schema).map(Some)
                }
                _ => Err(FrontendError::invalid(
                    "response_format.json_schema.schema",
                    "response_format.json_schema needs a `schema`",
                )),
            }
        }
        other => Err(FrontendError::invalid(
            P,
            format!(
                "response_format.type must be `text`, `json_object` or `json_schema`, got {}",
                other.map_or_else(|| "nothing".to_owned(), |t| format!("`{t}`"))
            ),
        )),
    }
}

fn structured_outputs(value: &Value) -> Result<Option<(GrammarSpec, String)>, FrontendError> {
    const P: &str = "structured_outputs";
    let Some(obj) = value.as_object() else {
        return Err(FrontendError::invalid(P, "structured_outputs must be an object"));
    };
    let mut found = None;
    for (key, v) in obj {
        if v.is_null() || (key == "json_object" && v == &Value::Bool(false)) {
            continue;
        }
        let param = format!("{P}.{key}");
        if !STRUCTURED_OUTPUT_KEYS.contains(&key.as_str()) {
            return Err(FrontendError::invalid(
                param.clone(),
                format!(
                    "Unsupported parameter `{param}`: only json, regex, choice, grammar and json_object are honoured"
                ),
            ));
        }
        let spec = match key.as_str() {
            "json" => json_schema(&param, v)?,
            "regex" => GrammarSpec::Regex(string(&param, v)?),
            "choice" => choices(&param, v)?,
            "grammar" => GrammarSpec::Lark(string(&param, v)?),
            _ if v == &Value::Bool(true) => GrammarSpec::JsonObject,
            _ => return Err(FrontendError::invalid(param, "structured_outputs.json_object must be a boolean")),
        };
        if let Some((_, first)) = &found {
            return Err(FrontendError::invalid(
                param.clone(),
                format!("structured_outputs may set only one constraint, got `{first}` and `{param}`"),
            ));
        }
        found = Some((spec, param));
    }
    Ok(found)
}

/// The request's output constraint and the field it came from; a 400 naming the field when
/// one is malformed or when more than one is given.
pub fn grammar(fields: &StructuredFields) -> Result<Option<GrammarCheck>, FrontendError> {
    let mut found: Vec<GrammarCheck> = Vec::new();
    let mut add = |param: &str, spec: Option<GrammarSpec>| {
        if let Some(spec) = spec {
            found.push(GrammarCheck { param: param.to_owned(), spec });
        }
    };
    if let Some(v) = fields.response_format.as_ref().filter(|v| !v.is_null()) {
        add("response_format", response_format(v)?);
    }
    if let Some(v) = fields.guided_json.as_ref().filter(|v| !v.is_null()) {
        add("guided_json", Some(json_schema("guided_json", v)?));
    }
    if let Some(v) = &fields.guided_regex {
        add("guided_regex", Some(GrammarSpec::Regex(v.clone())));
    }
    if let Some(v) = fields.guided_choice.as_ref().filter(|v| !v.is_null()) {
        add("guided_choice", Some(choices("guided_choice", v)?));
    }
    if let Some(v) = &fields.guided_grammar {
        add("guided_grammar", Some(GrammarSpec::Lark(v.clone())));
    }
    if let Some(v) = fields.structured_outputs.as_ref().filter(|v| !v.is_null())
        && let Some((spec, param)) = structured_outputs(v)?
    {
        add(&param, Some(spec));
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => Err(FrontendError::invalid(
            found[1].param.clone(),
            format!("only one output constraint per request, got `{}` and `{}`", found[0].param, found[1].param),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<GrammarCheck>, FrontendError> {
        grammar(&serde_json::from_value(v).expect("fields"))
    }

    #[test]
    fn each_field_maps_to_its_spec_and_names_itself() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (json!({"response_format": {"type": "json_object"}}), "response_format", GrammarSpec::JsonObject),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                "response_format",
                GrammarSpec::JsonSchema(schema.to_string()),
            ),
            (json!({"guided_json": schema}), "guided_json", GrammarSpec::JsonSchema(schema.to_string())),
            (json!({"guided_json": schema.to_string()}), "guided_json", GrammarSpec::JsonSchema(schema.to_string())),
            (json!({"guided_regex": "a+"}), "guided_regex", GrammarSpec::Regex("a+".into())),
            (json!({"guided_choice": ["x", "y"]}), "guided_choice", GrammarSpec::Choice(vec!["x".into(), "y".into()])),
            (json!({"guided_grammar": "start: \"a\""}), "guided_grammar", GrammarSpec::Lark("start: \"a\"".into())),
            (json!({"structured_outputs": {"regex": "b"}}), "structured_outputs.regex", GrammarSpec::Regex("b".into())),
            (
                json!({"structured_outputs": {"json_object": true, "regex": null}}),
                "structured_outputs.json_object",
                GrammarSpec::JsonObject,
            ),
            (
                json!({"structured_outputs": {"choice": ["a"]}}),
                "structured_outputs.choice",
                GrammarSpec::Choice(vec!["a".into()]),
            ),
        ];
        for (body, param, spec) in cases {
            let check = parse(body.clone()).expect("valid").expect("constrained");
            assert_eq!((check.param.as_str(), check.spec), (param, spec), "{body}");
        }
        assert_eq!(parse(json!({"response_format": {"type": "text"}})).expect("text"), None);
        assert_eq!(parse(json!({})).expect("none"), None);
    }

    #[test]
    fn malformed_and_conflicting_constraints_are_named() {
        let cases = [
            (json!({"response_format": {"type": "yaml"}}), "response_format"),
            (json!({"response_format": {"type": "json_schema"}}), "response_format.json_schema"),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format.json_schema.schema",
            ),
            (json!({"guided_json": "not json"}), "guided_json"),
            (json!({"guided_json": 3}), "guided_json"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"structured_outputs": {"regex": 1}}), "structured_outputs.regex"),
            (json!({"structured_outputs": {"whitespace_pattern": " "}}), "structured_outputs.whitespace_pattern"),
            (json!({"structured_outputs": {"regex": "a", "grammar": null, "json_object": false}}), "-"),
            (json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}), "guided_regex"),
        ];
        // Two constraints inside structured_outputs: the message names both (map order aside).
        let e = parse(json!({"structured_outputs": {"regex": "a", "choice": ["b"]}})).expect_err("two");
        assert!(e.param().is_some_and(|p| p == "structured_outputs.regex" || p == "structured_outputs.choice"), "{e}");
        assert!(
            e.to_string().contains("structured_outputs.regex") && e.to_string().contains("structured_outputs.choice")
        );
        for (body, param) in cases {
            if param == "-" {
                // Nulls and `json_object: false` are no constraint.
                assert!(parse(body).expect("one constraint").is_some());
                continue;
            }
            let e = parse(body.clone()).expect_err("refused");
            assert_eq!(e.param(), Some(param), "{body}: {e}");
        }
    }
}
