//! Reading `config.json`'s fields: the text-config-then-root fallback, typed getters with their
//! limits, and errors that name the field.

use serde_json::{Map, Value};

use super::error::{ConfigError, MAX_DIM, Result};
use super::types::QuantizationConfig;

/// Field access with the text-config-then-root fallback and errors that name the field.
pub(super) struct Fields<'a> {
    pub(super) text: Option<&'a Map<String, Value>>,
    pub(super) root: &'a Map<String, Value>,
    /// Dotted path of this object, for error messages (`""` at the top).
    pub(super) prefix: String,
}

impl<'a> Fields<'a> {
    pub(super) fn path(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    pub(super) fn lookup(&self, key: &str) -> Option<&'a Value> {
        self.text
            .and_then(|t| t.get(key))
            .or_else(|| self.root.get(key))
    }

    pub(super) fn value(&self, key: &str) -> Result<&'a Value> {
        self.lookup(key).ok_or_else(|| ConfigError::Missing {
            field: self.path(key),
        })
    }

    pub(super) fn wrong(&self, key: &str, expected: &'static str, found: &Value) -> ConfigError {
        ConfigError::WrongType {
            field: self.path(key),
            expected,
            found: kind(found),
        }
    }

    pub(super) fn object(&self, key: &str) -> Result<Fields<'a>> {
        match self.value(key)? {
            Value::Object(map) => Ok(Fields {
                text: None,
                root: map,
                prefix: format!("{}.", self.path(key)),
            }),
            other => Err(self.wrong(key, "an object", other)),
        }
    }

    pub(super) fn string(&self, key: &str) -> Result<String> {
        match self.value(key)? {
            Value::String(s) => Ok(s.clone()),
            other => Err(self.wrong(key, "a string", other)),
        }
    }

    pub(super) fn boolean(&self, key: &str) -> Result<bool> {
        match self.value(key)? {
            Value::Bool(b) => Ok(*b),
            other => Err(self.wrong(key, "true or false", other)),
        }
    }

    /// A non-negative integer at most [`MAX_DIM`].
    pub(super) fn as_count(&self, key: &str, value: &Value) -> Result<usize> {
        let n = value
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| self.wrong(key, "a non-negative integer", value))?;
        if n > MAX_DIM {
            return Err(invalid(
                &self.path(key),
                format!("{n} exceeds the limit {MAX_DIM}"),
            ));
        }
        Ok(n)
    }

    /// A non-negative integer.
    pub(super) fn count(&self, key: &str) -> Result<usize> {
        self.as_count(key, self.value(key)?)
    }

    /// A positive integer (a width, a count of things that must exist).
    pub(super) fn positive(&self, key: &str) -> Result<usize> {
        match self.count(key)? {
            0 => Err(invalid(&self.path(key), "must be at least 1".into())),
            n => Ok(n),
        }
    }

    pub(super) fn optional_count(&self, key: &str) -> Result<Option<usize>> {
        match self.lookup(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => self.as_count(key, value).map(Some),
        }
    }

    pub(super) fn as_float(&self, key: &str, value: &Value) -> Result<f32> {
        value
            .as_f64()
            .map(|v| v as f32)
            .ok_or_else(|| self.wrong(key, "a number", value))
    }

    pub(super) fn float(&self, key: &str) -> Result<f32> {
        self.as_float(key, self.value(key)?)
    }

    /// A finite number above 0.
    pub(super) fn finite_positive(&self, key: &str) -> Result<f32> {
        let v = self.float(key)?;
        if v > 0.0 && v.is_finite() {
            Ok(v)
        } else {
            Err(invalid(
                &self.path(key),
                format!("{v} is not a positive number"),
            ))
        }
    }

    /// A number that may be absent (or null): absence has a meaning for this field.
    pub(super) fn optional_float(&self, key: &str) -> Result<Option<f32>> {
        match self.lookup(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => self.as_float(key, value).map(Some),
        }
    }

    /// A number that must be present but may be `null`.
    pub(super) fn nullable_float(&self, key: &str) -> Result<Option<f32>> {
        match self.value(key)? {
            Value::Null => Ok(None),
            value => self.as_float(key, value).map(Some),
        }
    }

    /// A list of 1-based layer numbers, returned 0-based, each in `1..=num_layers`, no repeats.
    pub(super) fn one_based_layers(&self, key: &str, num_layers: usize) -> Result<Vec<usize>> {
        let value = self.value(key)?;
        let Value::Array(items) = value else {
            return Err(self.wrong(key, "a list of 1-based layer numbers", value));
        };
        let mut layers = Vec::with_capacity(items.len());
        for item in items {
            let n = self.as_count(key, item)?;
            if n == 0 || n > num_layers {
                return Err(invalid(
                    &self.path(key),
                    format!("layer {n} is outside 1..={num_layers} (the lists are 1-based)"),
                ));
            }
            if layers.contains(&(n - 1)) {
                return Err(invalid(
                    &self.path(key),
                    format!("layer {n} is listed twice"),
                ));
            }
            layers.push(n - 1);
        }
        Ok(layers)
    }

    /// `quantization_config` from the text config first, then the root; absent means none.
    pub(super) fn quantization(&self) -> Result<Option<QuantizationConfig>> {
        let Some(value) = self.lookup("quantization_config") else {
            return Ok(None);
        };
        let Value::Object(map) = value else {
            return Err(self.wrong("quantization_config", "an object", value));
        };
        let q = Fields {
            text: None,
            root: map,
            prefix: "quantization_config.".into(),
        };
        let method = q.string("quant_method")?;
        if method != "compressed-tensors" {
            return Err(unsupported(
                "quantization_config.quant_method",
                &method,
                "only compressed-tensors",
            ));
        }
        let format = q.string("format")?;
        if format != "mxfp4-pack-quantized" {
            return Err(unsupported(
                "quantization_config.format",
                &format,
                "only mxfp4-pack-quantized",
            ));
        }
        let groups = q.object("config_groups")?;
        let mut group_size = None;
        for (name, group) in groups.root {
            let Value::Object(group) = group else {
                return Err(groups.wrong(name, "an object", group));
            };
            let g = Fields {
                text: None,
                root: group,
                prefix: format!("{}{name}.", groups.prefix),
            };
            let size = g.object("weights")?.positive("group_size")?;
            if size != 32 {
                return Err(unsupported(
                    &g.path("weights.group_size"),
                    &size.to_string(),
                    "MXFP4 groups are 32",
                ));
            }
            group_size = Some(size);
        }
        let group_size = group_size.ok_or_else(|| {
            invalid(
                "quantization_config.config_groups",
                "no group is declared".into(),
            )
        })?;
        let ignore = match q.lookup("ignore") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| {
                    item.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| q.wrong("ignore", "a list of strings", item))
                })
                .collect::<Result<_>>()?,
            Some(other) => return Err(q.wrong("ignore", "a list of strings", other)),
        };
        Ok(Some(QuantizationConfig {
            format,
            group_size,
            ignore,
        }))
    }
}

pub(super) fn kind(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("{s:?}"),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "an object".into(),
    }
}

pub(super) fn invalid(field: &str, reason: String) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_owned(),
        reason,
    }
}

pub(super) fn unsupported(field: &str, value: &str, reason: &'static str) -> ConfigError {
    ConfigError::Unsupported {
        field: field.to_owned(),
        value: value.to_owned(),
        reason,
    }
}
