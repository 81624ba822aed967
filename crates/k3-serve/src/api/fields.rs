//! A request body's fields as typed structs: a wrong type is a 400 that names the field (its
//! path, `messages[0].content`), and the top-level fields no struct reads are listed, so the
//! server can say which it ignored instead of dropping them without a word.

use serde::de::{DeserializeOwned, Visitor};
use serde_json::Value;

use super::error::ApiError;

/// `T` read from `body` (a JSON object): a field of the wrong type is a 400 naming it.
pub(super) fn typed<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::invalid("", format!("invalid request body: {inner}"))
        } else {
            ApiError::invalid(&path, format!("invalid value for `{path}`: {inner}"))
        }
    })
}

/// The body as an object, or a 400.
pub(super) fn object(body: &Value) -> Result<&serde_json::Map<String, Value>, ApiError> {
    body.as_object().ok_or_else(|| {
        ApiError::invalid(
            "",
            format!(
                "the request body must be a JSON object, got {}",
                kind_of(body)
            ),
        )
    })
}

/// The top-level keys of `body` that none of `known` names, in the body's order.
pub(super) fn unknown(body: &serde_json::Map<String, Value>, known: &[&[&str]]) -> Vec<String> {
    body.keys()
        .filter(|key| !known.iter().any(|names| names.contains(&key.as_str())))
        .cloned()
        .collect()
}

/// What JSON type `value` is, for messages.
pub(super) fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The field names `T`'s derived `Deserialize` reads: serde hands them to
/// `Deserializer::deserialize_struct`, which this deserializer records and then refuses.
/// Empty for a type that is not a plain struct.
pub(super) fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(FieldNames(&mut fields));
    fields
}

struct FieldNames<'a>(&'a mut &'static [&'static str]);

impl<'de> serde::Deserializer<'de> for FieldNames<'_> {
    type Error = serde::de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(serde::de::Error::custom(
            "only a struct's field names are read",
        ))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        *self.0 = fields;
        Err(serde::de::Error::custom("field names recorded"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

#[cfg(test)]
mod tests;
