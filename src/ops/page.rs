//! The status page served at `/` of each instance: the whole fleet as the database shows it
//! ([`Overview`]: every bot with its lock and pass, the hosts pushing back) in one self-contained
//! HTML document — inline CSS, no script, no external asset (a fleet may have no internet) — that
//! reloads itself with a `<meta http-equiv="refresh">`. Every value that comes from outside (bot
//! ids, holders, hosts, error texts of hostile pages and seed sources) goes through [`escape`].

use std::fmt::Write as _;
use std::time::Duration;

use crate::ops::admin::{one_line, seconds, troubled_hosts, CrawlColumns, StatusRow};
use crate::ops::overview::Overview;

/// How often the page reloads itself, in seconds.
pub(crate) const REFRESH_SECONDS: u32 = 5;

/// The instance serving the page.
#[derive(Debug, Clone)]
pub(crate) struct Serving<'a> {
    pub instance: &'a str,
    pub uptime: Duration,
}

/// Escapes text for HTML element content and quoted attribute values.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "
body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:1.5em;color:#1d2330;background:#f6f7f9}
h1{font-size:20px;margin:0 0 .2em} h2{font-size:16px;margin:1.6em 0 .5em}
.meta{color:#5b6475;margin-bottom:1em} .meta b{color:#1d2330}
table{border-collapse:collapse;width:100%;background:#fff;box-shadow:0 1px 2px #0002}
th,td{text-align:left;padding:.45em .6em;border-bottom:1px solid #e4e7ec;vertical-align:top}
th{background:#eef0f4;font-weight:600;font-size:12px;text-transform:uppercase;letter-spacing:.03em;color:#4a5263}
.state{display:inline-block;padding:.1em .55em;border-radius:1em;font-weight:600;font-size:12px}
.state-ready{background:#d8f3dc;color:#1b5e20} .state-waiting{background:#fff3cd;color:#7a5b00}
.state-updating{background:#dbe8ff;color:#0b3d91} .state-error{background:#fde2e1;color:#9b1c1c}
.state-other{background:#e4e7ec;color:#4a5263} .state-paused{background:#ece4ff;color:#4b2a91}
.bar{display:flex;height:12px;width:260px;background:#e4e7ec;border-radius:6px;overflow:hidden;margin:.2em 0}
.bar span{display:block;height:100%} .done{background:#2e7d32} .failed{background:#c62828}
.leased{background:#1e63d6} .small{color:#5b6475;font-size:12px} .err{color:#9b1c1c;max-width:32em;word-break:break-word}
.legend span{display:inline-block;width:.8em;height:.8em;border-radius:2px;margin:0 .2em 0 .8em;vertical-align:-1px}
code{font:12px ui-monospace,monospace}
";

fn state_class(state: &str) -> &'static str {
    match state {
        "ready" => "state-ready",
        "waiting" => "state-waiting",
        "updating" => "state-updating",
        "error" => "state-error",
        _ => "state-other",
    }
}

fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        (part as f64 * 100.0 / whole as f64).min(100.0)
    }
}

fn pass_cell(c: &CrawlColumns) -> String {
    let whole = c.size().pages().max(c.discovered_pages);
    let mut out = format!(
        "<div>pass {}{}{}</div>",
        c.pass,
        if c.finished { " (done)" } else { "" },
        if c.next_pass_waiting {
            " (next waiting)"
        } else {
            ""
        }
    );
    let _ = write!(
        out,
        "<div class=\"bar\" title=\"done {d}, failed {f}, leased {l}, pending {p}\">\
         <span class=\"done\" style=\"width:{:.1}%\"></span>\
         <span class=\"failed\" style=\"width:{:.1}%\"></span>\
         <span class=\"leased\" style=\"width:{:.1}%\"></span></div>",
        percent(c.done, whole),
        percent(c.failed, whole),
        percent(c.leased, whole),
        d = c.done,
        f = c.failed,
        l = c.leased,
        p = c.pending,
    );
    let _ = write!(
        out,
        "<div class=\"small\">{} done · {} pending · {} leased · {} failed of {} · {:.1} pages/s · ETA {} · oldest pending {}</div>",
        c.done,
        c.pending,
        c.leased,
        c.failed,
        escape(&c.size().label()),
        c.pages_per_second,
        escape(&c.eta_text()),
        seconds(c.oldest_pending_seconds.map(|s| -s)),
    );
    out
}

/// The pass cell: the pass, then what the last completed pass's deletion evaluation did.
fn crawl_cell(r: &StatusRow) -> String {
    let mut out = r
        .crawl
        .as_ref()
        .map_or_else(|| "<span class=\"small\">-</span>".into(), pass_cell);
    if let Some(failure) = r.crawl.as_ref().and_then(|c| c.top_failure.as_ref()) {
        let _ = write!(
            out,
            "<div class=\"small\">top failure: {}</div>",
            escape(&crate::ops::admin::failure_text(failure))
        );
    }
    if let Some(evaluation) = &r.last_evaluation {
        let _ = write!(
            out,
            "<div class=\"small\">last evaluation: {}</div>",
            escape(evaluation)
        );
    }
    if let Some(dropped) = &r.dropped {
        let _ = write!(
            out,
            "<div class=\"small\">trap bounds dropped: {}</div>",
            escape(dropped)
        );
    }
    out
}

fn bot_row(r: &StatusRow) -> String {
    let lock = match &r.holder {
        Some(holder) => format!(
            "<b>{}</b><div class=\"small\">epoch {} · held {} · expires in {}</div>",
            escape(holder),
            r.epoch.map_or("-".into(), |e| e.to_string()),
            seconds(r.lock_age_seconds).trim_end_matches(" ago"),
            seconds(r.expires_in_seconds),
        ),
        None => format!(
            "<span class=\"small\">free · epoch {}</span>",
            r.epoch.map_or("-".into(), |e| e.to_string())
        ),
    };
    let error = match &r.last_error {
        Some(e) if r.failed_refreshes > 0 => format!(
            "<div class=\"err\">({}×) {}</div>",
            r.failed_refreshes,
            escape(&one_line(e, 300))
        ),
        Some(e) => format!("<div class=\"err\">{}</div>", escape(&one_line(e, 300))),
        None => "<span class=\"small\">-</span>".into(),
    };
    // Why the row comes first (an error, a refresh past its time, paused).
    let error = match &r.attention {
        Some(why) if why != "error" => {
            format!("<div class=\"err\"><b>{}</b></div>{error}", escape(why))
        }
        _ => error,
    };
    format!(
        "<tr><td><b>{bot}</b></td><td><span class=\"state {class}\">{state}</span>{paused}</td><td>{lock}</td>\
         <td>{seeds}</td><td>{refresh}</td><td>{pass}</td><td>{error}</td></tr>\n",
        bot = escape(&r.bot),
        class = state_class(&r.state),
        state = escape(&r.state),
        paused = if r.paused {
            " <span class=\"state state-paused\">paused</span>"
        } else {
            ""
        },
        seeds = r.seeds,
        refresh = escape(r.last_refresh.as_deref().unwrap_or("-")),
        pass = crawl_cell(r),
    )
}

fn head(title: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"refresh\" content=\"{REFRESH_SECONDS}\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{}</title><style>{STYLE}</style></head><body>\n",
        escape(title)
    )
}

fn serving_line(serving: &Serving<'_>, extra: &str) -> String {
    format!(
        "<div class=\"meta\">served by <b>{}</b> · up {} · {extra}reloads every {REFRESH_SECONDS} s</div>\n",
        escape(serving.instance),
        humantime::format_duration(Duration::from_secs(serving.uptime.as_secs())),
    )
}

/// How many bots one status page lists.
pub(crate) const PAGE_ROWS: usize = 100;

/// The page for `fleet`: the counts, then page `page` (from 1; past the last is the last) of
/// [`PAGE_ROWS`] bots, those that need a look first, with links to the other pages.
pub(crate) fn render(fleet: &Overview, serving: &Serving<'_>, page: usize) -> String {
    let pages = fleet.rows.len().div_ceil(PAGE_ROWS).max(1);
    let page = page.clamp(1, pages);
    let first = (page - 1) * PAGE_ROWS;
    let shown = &fleet.rows[first..(first + PAGE_ROWS).min(fleet.rows.len())];
    let mut out = head("seedlock — fleet status");
    out.push_str("<h1>seedlock — fleet status</h1>\n");
    out.push_str(&serving_line(
        serving,
        &format!(
            "database time <b>{}</b> · ",
            fleet.now.format("%Y-%m-%d %H:%M:%S UTC")
        ),
    ));
    let _ = writeln!(
        out,
        "<h2>Bots ({})</h2>",
        escape(&crate::ops::admin::counts_line(&fleet.rows))
    );
    out.push_str(
        "<table><thead><tr><th>bot</th><th>state</th><th>lock</th><th>seeds</th>\
         <th>last refresh</th><th>crawl pass <span class=\"legend small\"><span class=\"done\"></span>done\
         <span class=\"failed\"></span>failed<span class=\"leased\"></span>leased</span></th>\
         <th>last error</th></tr></thead><tbody>\n",
    );
    for r in shown {
        out.push_str(&bot_row(r));
    }
    if fleet.rows.is_empty() {
        out.push_str("<tr><td colspan=\"7\" class=\"small\">no bot documents yet</td></tr>\n");
    }
    out.push_str("</tbody></table>\n");
    if pages > 1 {
        out.push_str(&page_links(
            page,
            pages,
            first,
            shown.len(),
            fleet.rows.len(),
        ));
    }
    let hosts = troubled_hosts(&fleet.hosts, fleet.now);
    out.push_str("<h2>Hosts throttled in the last minute or paused</h2>\n");
    if hosts.is_empty() {
        out.push_str("<p class=\"small\">none: no host pushed back lately</p>\n");
    } else {
        out.push_str(
            "<table><thead><tr><th>host</th><th>instance</th><th>limit</th><th>in flight</th>\
             <th>throttles</th><th>last throttle</th><th>paused for</th></tr></thead><tbody>\n",
        );
        for h in hosts {
            let _ = writeln!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{:.1}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&h.host),
                escape(&h.instance),
                h.limit,
                h.in_flight,
                h.throttles,
                seconds(h.last_throttle_at.map(|t| (t - fleet.now).num_seconds())),
                seconds(
                    h.paused_until
                        .filter(|u| *u > fleet.now)
                        .map(|u| (u - fleet.now).num_seconds().max(1))
                ),
            );
        }
        out.push_str("</tbody></table>\n");
    }
    out.push_str(
        "<p class=\"small\">The same data: <a href=\"/status.json\">/status.json</a> \
         (as <code>seedlock status --json</code>) · <a href=\"/metrics\">/metrics</a> · \
         <a href=\"/healthz\">/healthz</a></p>\n</body></html>\n",
    );
    out
}

/// The line under a paged table: which bots are shown, and links to the first, previous, next
/// and last pages (plain links, so the reload keeps the page).
fn page_links(page: usize, pages: usize, first: usize, shown: usize, total: usize) -> String {
    let link = |to: usize, text: &str| {
        if to == page {
            format!("<span class=\"small\">{text}</span>")
        } else {
            format!("<a href=\"/?page={to}\">{text}</a>")
        }
    };
    format!(
        "<p class=\"pages\">bots {}–{} of {total} (page {page} of {pages}, those that need a look \
         first) · {} · {} · {} · {}</p>\n",
        first + 1,
        first + shown,
        link(1, "« first"),
        link(page.saturating_sub(1).max(1), "‹ previous"),
        link((page + 1).min(pages), "next ›"),
        link(pages, "last »"),
    )
}

/// The page when the database could not be read: the error, escaped, and the same reload.
pub(crate) fn render_unavailable(error: &str, serving: &Serving<'_>) -> String {
    let mut out = head("seedlock — database unavailable");
    out.push_str("<h1>seedlock — fleet status</h1>\n");
    out.push_str(&serving_line(serving, ""));
    let _ = writeln!(
        out,
        "<p class=\"err\">The database could not be read: {}</p></body></html>",
        escape(&one_line(error, 500))
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::admin::{status_rows, with_pass};
    use crate::store::frontier::PassProgress;
    use crate::store::hosts::HostRow;
    use crate::store::passes::PassReport;
    use bson::doc;
    use chrono::TimeZone;

    #[test]
    fn escape_neutralises_markup_and_quotes() {
        assert_eq!(
            escape(r#"<script>alert("x")</script> & 'y'"#),
            "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;y&#39;"
        );
    }

    #[test]
    fn the_page_shows_bots_passes_and_hosts_with_every_outside_value_escaped() {
        let now = chrono::Utc.with_ymd_and_hms(2026, 12, 1, 12, 0, 0).unwrap();
        let docs = vec![
            doc! {"_id": "shop", "isReady": true, "isEditing": false, "seeds": ["http://x/"], "lockEpoch": 3_i64},
            doc! {"_id": "feed", "isReady": false, "isEditing": false, "seeds": [], "lockEpoch": 2_i64,
            "lastError": "seed source answered <script>alert(1)</script>", "failedRefreshes": 2_i64},
        ];
        let mut rows = status_rows(docs, &[], now);
        let report = PassReport {
            pass: crate::ids::PassNumber::new(4),
            progress: PassProgress {
                pending: 30,
                waiting: 0,
                leased: 10,
                done: 50,
                failed: 10,
            },
            started_at: Some(now - chrono::Duration::seconds(30)),
            ended_at: None,
            oldest_pending: Some(now - chrono::Duration::seconds(7)),
            top_failure: Some(crate::store::frontier::FailureReason {
                reason: "no natural key (<b>.skuu</b>) on the page".into(),
                count: 10,
                example: "http://x/product/<1>".into(),
            }),
        };
        with_pass(&mut rows[0], &report, Some(200), now);
        let fleet = Overview {
            now,
            rows,
            hosts: vec![HostRow {
                host: "evil<b>:80".into(),
                instance: "i-1".into(),
                limit: 2.5,
                in_flight: 1,
                throttles: 4,
                last_throttle_at: Some(now - chrono::Duration::seconds(3)),
                paused_until: None,
                updated_at: now,
            }],
        };
        let page = render(
            &fleet,
            &Serving {
                instance: "i-<1>",
                uptime: Duration::from_secs(75),
            },
            1,
        );
        assert!(page.contains("<meta http-equiv=\"refresh\" content=\"5\">"));
        assert!(
            !page.contains("class=\"pages\""),
            "one page has no page links"
        );
        assert!(!page.contains("<script"), "{page}");
        assert!(page.contains("seed source answered &lt;script&gt;alert(1)&lt;/script&gt;"));
        assert!(page.contains("evil&lt;b&gt;:80") && page.contains("i-&lt;1&gt;"));
        assert!(page.contains("up 1m 15s"));
        assert!(
            page.contains("top failure: 10× no natural key (&lt;b&gt;.skuu&lt;/b&gt;) on the page (e.g. http://x/product/&lt;1&gt;)"),
            "{page}"
        );
        // 50 done of ~200 expected: a quarter of the bar; 140 left at 2 pages/s.
        assert!(page.contains("style=\"width:25.0%\""), "{page}");
        assert!(page.contains("of ~200 · 2.0 pages/s · ETA 1m 10s (~200 pages)"));
        assert!(page.contains("(2×) seed source"));
        assert!(page.contains("1 ready · 0 waiting · 0 updating · 1 error"));
    }

    #[test]
    fn a_large_fleet_is_paged_with_the_bots_that_need_a_look_on_the_first_page() {
        let now = chrono::Utc
            .with_ymd_and_hms(2026, 11, 30, 12, 0, 0)
            .unwrap();
        let at = bson::DateTime::from_chrono(now - chrono::Duration::hours(1));
        let mut docs: Vec<bson::Document> = (0..250)
            .map(|i| doc! {"_id": format!("fine{i:03}"), "isReady": true, "isEditing": false,
            "seeds": ["x"], "lockEpoch": 1_i64, "lastSeedUpdatedAt": at, "lastUpdateStartedAt": at})
            .collect();
        docs.push(
            doc! {"_id": "zbroken", "isReady": false, "isEditing": false, "seeds": [],
            "lockEpoch": 1_i64, "lastError": "refresh failed: 500"},
        );
        let mut rows = status_rows(docs, &[], now);
        crate::ops::admin::problems_first(&mut rows);
        let fleet = Overview {
            now,
            rows,
            hosts: vec![],
        };
        let serving = Serving {
            instance: "i-1",
            uptime: Duration::from_secs(1),
        };
        let bots = |page: &str| page.matches("<tr><td><b>").count();
        let first = render(&fleet, &serving, 1);
        assert!(
            first.contains("251 bots: 250 ready"),
            "the counts cover every page"
        );
        assert_eq!(bots(&first), PAGE_ROWS, "{first}");
        let broken = first.find("zbroken").expect("the broken bot on page 1");
        assert!(
            broken < first.find("fine000").unwrap(),
            "it leads the table"
        );
        assert!(first.contains("bots 1–100 of 251 (page 1 of 3"), "{first}");
        assert!(
            first.contains("<a href=\"/?page=2\">next ›</a>")
                && first.contains("<a href=\"/?page=3\">last »</a>")
        );
        let last = render(&fleet, &serving, 3);
        assert_eq!(bots(&last), 51);
        assert!(last.contains("bots 201–251 of 251 (page 3 of 3"), "{last}");
        assert!(last.contains("<a href=\"/?page=2\">‹ previous</a>"));
        assert_eq!(
            render(&fleet, &serving, 99),
            last,
            "past the last page is the last"
        );
        assert_eq!(render(&fleet, &serving, 0), first);
    }
}
