//! UTC calendar dates and RFC 3339 stamps of given times (seconds since the epoch), without a
//! date library: what logs, registry entries and the probe budget's day keys print.

/// RFC 3339 UTC timestamp of `secs`, seconds precision.
pub fn rfc3339(secs: u64) -> String {
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
}
