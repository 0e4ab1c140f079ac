//! `seedlock try BOT URL`: one page fetched and read as the crawl would, printed for a person
//! writing a bot (or as JSON). Exit 0 when the page yields what its kind needs, 1 when it does
//! not or cannot be fetched, 2 for bad usage.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::config::{BotSettings, CrawlLimits, CrawlSettings, SeedSource, Settings};
use crate::crawl::probe::{self, Examined, Hop, Kind};
use crate::flow::robots::RobotsCache;
use crate::http_client::{BodyFormat, HttpClient, Page};
use crate::ops::{bot_arg, fail, EXIT_FAILED, EXIT_USAGE};
use crate::urls::NormalizedUrl;

/// What to try: a URL to fetch, or a saved page read as if fetched from `url`.
pub(crate) struct Request {
    pub bot: String,
    pub url: Option<String>,
    pub file: Option<PathBuf>,
    pub json: bool,
    pub ignore_robots: bool,
}

/// The report, as `--json` prints it.
#[derive(Serialize)]
struct Report<'a> {
    bot: &'a str,
    url: &'a str,
    /// Where the page came from: `fetched`, or the saved file's path.
    source: String,
    headers: Vec<(String, String)>,
    redirects: &'a [Hop],
    /// Why no page was had (then nothing else is read).
    fetch_error: Option<&'a str>,
    bytes: Option<usize>,
    #[serde(flatten)]
    examined: Option<&'a Examined>,
}

pub(crate) async fn command(settings: Settings, request: Request) -> ExitCode {
    let id = match bot_arg(&request.bot) {
        Ok(id) => id,
        Err(code) => return code,
    };
    let url = match page_url(&request) {
        Ok(u) => u,
        Err(code) => return code,
    };
    let (bot, stored_seeds) = match find_bot(&settings, &id).await {
        Ok(found) => found,
        Err(code) => return code,
    };
    let Some(rules) = bot.crawl.clone() else {
        return fail(
            EXIT_USAGE,
            format!("bot \"{id}\" has no [bots.crawl] section: there is nothing to try"),
        );
    };
    let seeds = match stored_seeds {
        Some(seeds) => seeds,
        None => seeds_of(&settings, &bot).await,
    };
    // What the requests carry besides the page's own: headers, user agent, cookies, proxy
    // (each secret as `<from $NAME>`).
    let mut headers = rules.headers.shown();
    if let Some(agent) = &rules.http.user_agent {
        headers.push(("User-Agent".into(), agent.clone()));
    }
    headers.extend(rules.http.shown());
    let Obtained { hops, page, source } =
        match obtain(&request, &settings.crawl, &rules, &url).await {
            Ok(obtained) => obtained,
            Err(code) => return code,
        };
    let examined = page.as_ref().ok().map(|page| {
        let kind = probe::kind_of(&rules, &page.url, &seeds);
        let body = match &page.sitemap {
            Some((read, _)) => probe::Body::Sitemap(read),
            None => probe::Body::Text(&page.body, page.format),
        };
        probe::examine(id.as_str(), &rules, kind, &page.url.to_url(), body)
    });
    let report = Report {
        bot: id.as_str(),
        url: url.as_str(),
        source,
        headers,
        redirects: &hops,
        fetch_error: page.as_ref().err().map(String::as_str),
        bytes: page.as_ref().ok().map(|page| {
            page.sitemap.as_ref().map_or(page.body.len(), |s| {
                usize::try_from(s.0.bytes).unwrap_or(usize::MAX)
            })
        }),
        examined: examined.as_ref(),
    };
    if let Err(code) = print_report(&report, request.json) {
        return code;
    }
    match (&page, &examined) {
        (Err(why), _) => fail(EXIT_FAILED, format!("{url}: no page: {why}")),
        (_, Some(e)) if e.ok => ExitCode::SUCCESS,
        (_, Some(e)) => fail(EXIT_FAILED, format!("{url}: {}", e.verdict)),
        (_, None) => ExitCode::from(EXIT_FAILED),
    }
}

/// The URL to try, normalized: `--url`'s (a saved page needs it too); bad usage without one.
fn page_url(request: &Request) -> Result<NormalizedUrl, ExitCode> {
    let raw_url = match (&request.url, &request.file) {
        (Some(url), _) => url.clone(),
        (None, Some(_)) => {
            return Err(fail(
                EXIT_USAGE,
                "--file needs the URL the page was saved from (--url URL)",
            ))
        }
        (None, None) => {
            return Err(fail(
                EXIT_USAGE,
                "name the page to try: seedlock try BOT URL",
            ))
        }
    };
    NormalizedUrl::parse(&raw_url).map_err(|e| fail(EXIT_USAGE, format!("{raw_url:?}: {e}")))
}

/// The page as had: the redirects followed on the way, the page (its final URL, body and format)
/// or why there is none, and where it came from (`fetched`, or the saved file's path).
struct Obtained {
    hops: Vec<Hop>,
    page: Result<Page, String>,
    source: String,
}

/// Reads the saved page of `--file`, else fetches `url` as the crawl would (the bot's headers,
/// robots.txt unless ignored, redirects); an error code when the file cannot be read or the
/// fetcher cannot be built.
async fn obtain(
    request: &Request,
    limits: &CrawlLimits,
    rules: &CrawlSettings,
    url: &NormalizedUrl,
) -> Result<Obtained, ExitCode> {
    if let Some(path) = &request.file {
        return match read_saved(path, limits.max_page_bytes) {
            Ok(body) => Ok(Obtained {
                hops: Vec::new(),
                page: {
                    let format = saved_format(path, &body);
                    Ok(Page {
                        url: url.clone(),
                        format,
                        body,
                        sitemap: None,
                        etag: None,
                        last_modified: None,
                    })
                },
                source: path.display().to_string(),
            }),
            Err(e) => Err(fail(EXIT_USAGE, e)),
        };
    }
    let fetcher = match HttpClient::new(&limits.user_agent, limits.timeout, limits.max_page_bytes) {
        Ok(f) => f.for_bot(&rules.headers, &rules.http, &rules.links.scope),
        Err(e) => return Err(fail(EXIT_FAILED, e)),
    };
    let robots = RobotsCache::new(
        &limits.user_agent,
        limits.robots_ttl,
        limits.robots && !request.ignore_robots,
    );
    let (hops, page) = probe::fetch(&fetcher, &robots, rules, url).await;
    Ok(Obtained {
        hops,
        page,
        source: "fetched".to_owned(),
    })
}

/// A saved page's format: JSON when its name ends in `.json` or its text opens with `{` or `[`;
/// a sitemap when its name ends in `.xml` or its text opens with `<?xml`.
fn saved_format(path: &std::path::Path, body: &str) -> BodyFormat {
    let named = |ext: &str| {
        path.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case(ext))
    };
    let text = body.trim_start();
    if named("json") || text.starts_with(['{', '[']) {
        BodyFormat::Json
    } else if named("xml") || text.starts_with("<?xml") {
        BodyFormat::Sitemap
    } else {
        BodyFormat::Html
    }
}

/// Prints the report: as JSON with `--json`, else for a person; an error code when the JSON
/// cannot be written.
fn print_report(report: &Report<'_>, json: bool) -> Result<(), ExitCode> {
    if json {
        match serde_json::to_string_pretty(report) {
            Ok(text) => println!("{text}"),
            Err(e) => return Err(fail(EXIT_FAILED, format!("cannot write the report: {e}"))),
        }
    } else {
        print!("{}", render(report));
    }
    Ok(())
}

/// The bot `id` of the config file, else of the database (with the seeds its document holds).
async fn find_bot(
    settings: &Settings,
    id: &crate::ids::BotId,
) -> Result<(BotSettings, Option<Vec<NormalizedUrl>>), ExitCode> {
    if let Some(bot) = settings.bots.iter().find(|b| &b.id == id) {
        return Ok((bot.clone(), None));
    }
    let (store, _) = crate::store::startup::open(&settings.mongo)
        .await
        .map_err(|e| fail(EXIT_USAGE, e))?;
    let raw = store.bots().load_raw(id).await;
    store.shutdown().await;
    let raw = match raw {
        Ok(Some(raw)) => raw,
        Ok(None) => {
            return Err(fail(
                EXIT_USAGE,
                format!("no bot \"{id}\" in the config or the database"),
            ))
        }
        Err(e) => return Err(fail(EXIT_FAILED, e)),
    };
    let Some(Ok(spec)) = crate::store::document::definition(&raw).spec else {
        return Err(fail(
            EXIT_USAGE,
            format!(
                "bot \"{id}\" has no spec in the database (its instances run it from their config)"
            ),
        ));
    };
    let bot = crate::config::bot_from_spec(id, &spec.spec)
        .map_err(|e| fail(EXIT_USAGE, format!("bot \"{id}\": {e}")))?;
    let seeds = crate::store::document::seeds(&raw)
        .iter()
        .filter_map(|s| NormalizedUrl::parse(s).ok())
        .collect();
    Ok((bot, Some(seeds)))
}

/// The bot's seeds, to tell a seed page from a listing page: its static list, or what its seed
/// source yields now (none when it cannot be read: the page is then taken for a listing page).
async fn seeds_of(settings: &Settings, bot: &BotSettings) -> Vec<NormalizedUrl> {
    if let SeedSource::Static(urls) = &bot.seeds {
        return urls.clone();
    }
    let Ok(fetcher) = crate::seeds::SeedReader::new(settings.refresh.clone()) else {
        return Vec::new();
    };
    match fetcher.fetch(&bot.seeds, &CancellationToken::new()).await {
        Ok(seeds) => seeds.urls,
        Err(e) => {
            eprintln!("seedlock: the seed source could not be read ({e}); the page is taken for a listing page if it is not a detail page");
            Vec::new()
        }
    }
}

/// A saved page, at most `max` bytes (as a fetched body is); invalid UTF-8 read lossily.
fn read_saved(path: &std::path::Path, max: usize) -> Result<String, String> {
    let len = std::fs::metadata(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?
        .len();
    if len > max as u64 {
        return Err(format!(
            "{}: {len} bytes, over crawl.max_page_bytes ({max}): the crawl would not read it",
            path.display()
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The report for a person: one block per part, one line per thing.
fn render(r: &Report<'_>) -> String {
    let mut out = String::new();
    write_page(&mut out, r);
    if let Some(why) = r.fetch_error {
        let _ = writeln!(out, "result: FAILED: no page: {why}");
        return out;
    }
    let Some(e) = r.examined else {
        return out;
    };
    write_kind_and_items(&mut out, e);
    write_record(&mut out, e);
    write_links(&mut out, e);
    for u in &e.unmatched {
        let _ = writeln!(
            out,
            "nothing matched: {} ({}): {}",
            u.key, u.selector, u.detail
        );
    }
    let verdict = if e.ok { "ok" } else { "FAILED" };
    let _ = writeln!(out, "result: {verdict}: {}", e.verdict);
    out
}

/// The page's block: the bot, the URL, where the page came from and its size, the headers sent
/// and the redirects followed.
fn write_page(out: &mut String, r: &Report<'_>) {
    let _ = writeln!(out, "bot: {}", r.bot);
    let _ = writeln!(out, "url: {}", r.url);
    match r.bytes {
        Some(n) => {
            let _ = writeln!(out, "page: {} ({n} bytes)", r.source);
        }
        None => {
            let _ = writeln!(out, "page: none");
        }
    }
    for (name, value) in &r.headers {
        let _ = writeln!(out, "header: {name}: {value}");
    }
    for hop in r.redirects {
        let _ = writeln!(out, "redirect: {} {} -> {}", hop.status, hop.from, hop.to);
    }
}

/// The page's kind and, unless it is a detail page, its items: each one's detail link,
/// fingerprint (with the fields it is made of) and update time.
fn write_kind_and_items(out: &mut String, e: &Examined) {
    let kind = match e.kind {
        Kind::Seed => "seed",
        Kind::Listing => "listing",
        Kind::Detail => "detail",
    };
    let _ = writeln!(out, "kind: {kind}");
    if e.kind != Kind::Detail {
        let _ = writeln!(out, "items: {}", e.items.len());
        for item in &e.items {
            let _ = writeln!(
                out,
                "  {} -> {}",
                item.id,
                item.link.as_deref().unwrap_or("(no detail link)")
            );
            let fields: Vec<String> = item
                .fingerprint_fields
                .iter()
                .map(|f| format!("{}={:?}", f.spec, f.value))
                .collect();
            let _ = writeln!(
                out,
                "    fingerprint {}: {}",
                item.fingerprint,
                fields.join(" ")
            );
            if let Some(raw) = &item.updated_at {
                let parsed = item.updated_at_parsed.as_deref().unwrap_or("not a time");
                let _ = writeln!(out, "    updated_at {raw:?} = {parsed}");
            }
        }
    }
}

/// The record the page yields, one line per field, or why it yields none.
fn write_record(out: &mut String, e: &Examined) {
    if let Some(record) = &e.record {
        let _ = writeln!(
            out,
            "record: {} (id {}, content hash {})",
            record.natural_key, record.id, record.content_hash
        );
        for (name, value) in &record.fields {
            match value {
                Some(v) => {
                    let _ = writeln!(out, "  {name} = {v:?}");
                }
                None => {
                    let _ = writeln!(out, "  {name} = null");
                }
            }
        }
    }
    if let Some(why) = &e.no_record {
        let _ = writeln!(out, "record: none: {why}");
    }
}

/// The links the crawl would follow, those it would not (with why), and how many were not read
/// past `max_links`.
fn write_links(out: &mut String, e: &Examined) {
    let _ = writeln!(out, "follows: {}", e.follows.len());
    for link in &e.follows {
        let _ = writeln!(out, "  {link}");
    }
    let _ = writeln!(out, "not followed: {}", e.refused.len() + e.refused_more);
    for refused in &e.refused {
        let _ = writeln!(out, "  {}: {}", refused.link, refused.why);
    }
    if e.refused_more > 0 {
        let _ = writeln!(out, "  … and {} more", e.refused_more);
    }
    if e.over_max_links > 0 {
        let _ = writeln!(
            out,
            "over max_links: {} links and items not read (bots.crawl.max_links)",
            e.over_max_links
        );
    }
}
