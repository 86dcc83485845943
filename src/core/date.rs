//! UTC calendar dates and RFC 3339 stamps of given times (seconds since the epoch), without a
//! date library: what logs, registry entries and the probe budget's day keys print; and the
//! one parser of durations every flag and file uses.

/// Why a text is no duration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DurationError {
    #[error("{0:?} is not a duration; use e.g. 30s, 500ms, 2m, 1h or 7d")]
    NotANumber(String),
    #[error("{0:?}: the unit must be ms, s, m, h or d")]
    Unit(String),
    /// Too long, or not above zero, for its use (whose longest it names).
    #[error("{0:?}: use a duration above 0 and at most {1}")]
    OutOfRange(String, &'static str),
}

/// A duration like `30s`, `500ms`, `2m`, `1h`, `7d` or `1.5s`; a bare number is seconds, as in
/// every flag that takes one (`--for`, `--timeout`). Above zero, at most a year.
pub(crate) fn parse_span(s: &str) -> Result<std::time::Duration, DurationError> {
    let t = s.trim();
    let (num, unit) = match t.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => t.split_at(i),
        None => (t, "s"),
    };
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| DurationError::NotANumber(s.to_string()))?;
    let secs = match unit {
        "ms" => n / 1_000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3_600.0,
        "d" => n * 86_400.0,
        _ => return Err(DurationError::Unit(s.to_string())),
    };
    let year = 366.0 * 86_400.0;
    if !(secs.is_finite() && secs > 0.0 && secs <= year) {
        return Err(DurationError::OutOfRange(s.to_string(), "366 d"));
    }
    std::time::Duration::try_from_secs_f64(secs)
        .map_err(|_| DurationError::OutOfRange(s.to_string(), "366 d"))
}

/// RFC 3339 UTC timestamp of `secs`, seconds precision.
pub(crate) fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}+00:00",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
}

/// The UTC date of `secs` (`2026-12-03`).
pub fn utc_date(secs: u64) -> String {
    let mut stamp = rfc3339(secs);
    stamp.truncate(10);
    stamp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00+00:00");
        assert_eq!(rfc3339(1_764_460_800), "2025-11-30T00:00:00+00:00");
        assert_eq!(rfc3339(951_782_400 + 3_661), "2000-02-29T01:01:01+00:00");
    }

    #[test]
    fn a_date_is_the_utc_day() {
        assert_eq!(utc_date(0), "1970-01-01");
        assert_eq!(utc_date(1_796_255_999), "2026-12-02");
        assert_eq!(utc_date(1_796_256_000), "2026-12-03");
    }

    #[test]
    fn one_parser_reads_every_duration_and_a_bare_number_is_seconds() {
        use std::time::Duration;
        assert_eq!(super::parse_span("90"), Ok(Duration::from_secs(90)));
        assert_eq!(super::parse_span("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(super::parse_span("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(super::parse_span(" 1.5h "), Ok(Duration::from_secs(5_400)));
        let unit = super::parse_span("3w").unwrap_err();
        assert!(unit.to_string().contains("ms, s, m, h or d"), "{unit}");
        assert!(super::parse_span("0s").is_err() && super::parse_span("400d").is_err());
    }
}
