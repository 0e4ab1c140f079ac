//! The chaos run's checks: lock histories, records against the shops, repeated requests, seeds
//! and logs.

use super::*;

/// 1. Per bot, lock epochs strictly increase, and every accepted holder write names the epoch
///    and the instance that won it: no two instances' writes accepted under one epoch.
pub fn check_history(history: &HashMap<String, Vec<Document>>, report: &mut ChaosReport) {
    for bot in BOTS {
        let entries = history.get(bot).cloned().unwrap_or_default();
        report.history_entries += entries.len();
        let mut highest = -1_i64;
        let mut owner: HashMap<i64, String> = HashMap::new();
        // Epochs whose holder made its last write: nothing more may be accepted under them.
        let mut closed: std::collections::HashSet<i64> = Default::default();
        for e in &entries {
            let event = e.get_str("event").unwrap_or("?");
            let by = e.get_str("by").unwrap_or("?").to_owned();
            let epoch = match e.get("epoch") {
                Some(Bson::Int64(n)) => *n,
                Some(Bson::Int32(n)) => i64::from(*n),
                _ => {
                    report
                        .violations
                        .push(format!("{bot}: history entry without an epoch: {e}"));
                    continue;
                }
            };
            match event {
                "created" | "acquired" | "took_over" | "repaired" | "unlocked" => {
                    // A contradiction repair keeps the holder's epoch; everything else raises it.
                    let raises = !(event == "repaired" && epoch == highest);
                    if raises && epoch <= highest {
                        report.violations.push(format!(
                            "{bot}: epoch {epoch} ({event} by {by}) does not exceed {highest}"
                        ));
                    }
                    highest = highest.max(epoch);
                    if event == "took_over" {
                        report.takeovers += 1;
                    }
                    if matches!(event, "acquired" | "took_over") {
                        if let Some(first) = owner.insert(epoch, by.clone()) {
                            report.violations.push(format!(
                                "{bot}: epoch {epoch} won twice, by {first} and by {by}"
                            ));
                        }
                    }
                }
                "refreshed" | "refresh_failed" | "released" => {
                    if event == "refreshed" {
                        report.refreshes += 1;
                    }
                    if !closed.insert(epoch) {
                        report.violations.push(format!(
                            "{bot}: {event} by {by} accepted under epoch {epoch} after its last write"
                        ));
                    }
                    match owner.get(&epoch) {
                        Some(o) if *o == by && epoch == highest => {}
                        Some(o) if *o == by => report.violations.push(format!(
                            "{bot}: {by}'s {event} under epoch {epoch} was accepted after epoch {highest} began"
                        )),
                        Some(o) => report.violations.push(format!(
                            "{bot}: {event} by {by} accepted under epoch {epoch}, which {o} holds"
                        )),
                        None => report.violations.push(format!(
                            "{bot}: {event} by {by} accepted under epoch {epoch}, which nobody won"
                        )),
                    }
                }
                _ => {}
            }
        }
    }
}

use crate::kit::try_get_json as get_json;

/// 2. Every product has exactly one record, equal to the shop's final state.
/// 2. Every product has exactly one record, equal to the shop's final state; the records of
///    deleted products are marked removed, and only those.
pub(super) async fn check_records(
    run: &Run,
    bot: &str,
    base: &str,
    mutated: &Mutated,
    report: &mut ChaosReport,
) {
    let Some(truth) = get_json(&format!("{base}/__truth")).await else {
        report
            .violations
            .push(format!("{bot}: the shop's truth could not be read"));
        return;
    };
    let truth: HashMap<String, [String; 3]> = truth["products"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let s = |k: &str| p[k].as_str().unwrap_or_default().to_owned();
            (s("sku"), [s("title"), s("price"), s("status")])
        })
        .collect();
    let Some(records) = bot_records(run, bot, report).await else {
        return;
    };
    report.records.insert(bot.to_owned(), records.len());
    let deleted = mutated.deleted.get(bot).cloned().unwrap_or_default();
    let mut by_key: HashMap<String, u32> = HashMap::new();
    let (mut wrong, mut removed, mut kept) = (Vec::new(), Vec::new(), Vec::new());
    for r in &records {
        let key = r.get_str("naturalKey").unwrap_or("?").to_owned();
        *by_key.entry(key.clone()).or_default() += 1;
        let is_removed = !matches!(r.get("removedAt"), None | Some(Bson::Null));
        match (is_removed, deleted.contains(&key)) {
            (true, true) => continue, // a deleted product, marked removed: right
            (false, true) => {
                kept.push(key);
                continue;
            }
            (true, false) => removed.push(key.clone()),
            (false, false) => {}
        }
        let data = r.get_document("data").cloned().unwrap_or_default();
        let got = ["title", "price", "status"].map(|f| data.get_str(f).unwrap_or("").to_owned());
        if truth.get(&key) != Some(&got) {
            wrong.push(key);
        }
    }
    let duplicates = by_key.values().filter(|&&n| n > 1).count();
    let missing = truth.keys().filter(|k| !by_key.contains_key(*k)).count();
    for (what, n) in [
        ("duplicate records", duplicates),
        ("products without a record", missing),
        ("records not equal to the shop", wrong.len()),
        ("records of existing products marked removed", removed.len()),
        ("records of deleted products not marked removed", kept.len()),
    ] {
        if n > 0 {
            report.violations.push(format!(
                "{bot}: {n} {what} (of {} products){}",
                truth.len(),
                match what {
                    "records not equal to the shop" =>
                        format!(", e.g. {:?}", &wrong[..wrong.len().min(3)]),
                    "records of existing products marked removed" =>
                        format!(", e.g. {:?}", &removed[..removed.len().min(3)]),
                    "records of deleted products not marked removed" =>
                        format!(", e.g. {:?}", &kept[..kept.len().min(3)]),
                    _ => String::new(),
                }
            ));
        }
    }
}

/// The bot's records; `None` (a violation reported) when they cannot be read.
async fn bot_records(run: &Run, bot: &str, report: &mut ChaosReport) -> Option<Vec<Document>> {
    match run
        .db
        .collection::<Document>("records")
        .find(doc! { "botId": bot })
        .await
    {
        Ok(cursor) => Some(cursor.try_collect().await.unwrap_or_default()),
        Err(e) => {
            report
                .violations
                .push(format!("{bot}: records unreadable: {e}"));
            None
        }
    }
}

/// 2b. The change feed is the records' exact log: replayed in `seq` order, each record's events
///    start with its `added`, each `from` is the value the events before it left, removals and
///    restorations alternate, and the replay ends at the stored record (its fields, removed or
///    not). Checked once the bot's last pass is released (else said so in the report).
pub(super) async fn check_events(run: &Run, bot: &str, report: &mut ChaosReport) {
    let Ok(Some(doc)) = run
        .db
        .collection::<Document>("bots")
        .find_one(doc! { "_id": bot })
        .await
    else {
        report
            .violations
            .push(format!("{bot}: the bot document could not be read"));
        return;
    };
    let feed = doc.get_document("crawlFeed").cloned().unwrap_or_default();
    let released = feed.get_i64("pass").ok() == doc.get_i64("crawlPass").ok()
        && doc
            .get("crawlPassEndedAt")
            .is_some_and(|v| !matches!(v, Bson::Null));
    if !released {
        report.notes.push(format!(
            "{bot}: its last pass is not released; events not checked"
        ));
        return;
    }
    let upto = feed.get_i64("seq").unwrap_or(0);
    let events: Vec<Document> = match run
        .db
        .collection::<Document>("changes")
        .find(doc! { "botId": bot, "seq": { "$lte": upto } })
        .sort(doc! { "botId": 1, "seq": 1 })
        .await
    {
        Ok(cursor) => cursor.try_collect().await.unwrap_or_default(),
        Err(e) => {
            report
                .violations
                .push(format!("{bot}: events unreadable: {e}"));
            return;
        }
    };
    let Some(records) = bot_records(run, bot, report).await else {
        return;
    };
    report.events.insert(bot.to_owned(), events.len());
    // Each record's state as its events leave it: its fields, and whether it is removed.
    let mut state: HashMap<String, (Document, bool)> = HashMap::new();
    let mut broken: Vec<String> = Vec::new();
    for e in &events {
        let id = e.get_str("recordId").unwrap_or("?").to_owned();
        let key = e.get_str("naturalKey").unwrap_or("?");
        let kind = e.get_str("kind").unwrap_or("?");
        let fields = e.get_document("fields").cloned().unwrap_or_default();
        let seq = e.get_i64("seq").unwrap_or(0);
        match (state.get_mut(&id), kind) {
            (None, "added") => {
                let data = fields
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.clone(),
                            v.as_document()
                                .and_then(|c| c.get("to"))
                                .cloned()
                                .unwrap_or(Bson::Null),
                        )
                    })
                    .collect();
                state.insert(id, (data, false));
            }
            (None, other) => broken.push(format!("#{seq} {key}: {other} before any `added`")),
            (Some(_), "added") => broken.push(format!("#{seq} {key}: added twice")),
            (Some((data, removed)), kind) => {
                match (kind, *removed) {
                    ("removed", false) => *removed = true,
                    ("restored", true) => *removed = false,
                    ("changed", false) => {}
                    (kind, removed) => {
                        broken.push(format!("#{seq} {key}: {kind} while removed={removed}"))
                    }
                }
                for (name, change) in &fields {
                    let Some(change) = change.as_document() else {
                        continue;
                    };
                    let from = change.get("from").cloned().unwrap_or(Bson::Null);
                    let now = data.get(name).cloned().unwrap_or(Bson::Null);
                    if from != now {
                        broken.push(format!("#{seq} {key}: {name} from {from} but it was {now}"));
                    }
                    data.insert(
                        name.clone(),
                        change.get("to").cloned().unwrap_or(Bson::Null),
                    );
                }
            }
        }
    }
    for r in &records {
        let id = r.get_str("_id").unwrap_or("?");
        let key = r.get_str("naturalKey").unwrap_or("?");
        let removed = !matches!(r.get("removedAt"), None | Some(Bson::Null));
        let data = r.get_document("data").cloned().unwrap_or_default();
        match state.remove(id) {
            None => broken.push(format!("{key}: a record without events")),
            Some((replayed, was_removed)) => {
                if was_removed != removed {
                    broken.push(format!("{key}: the events leave it removed={was_removed}, the record says {removed}"));
                }
                let same = ["title", "price", "status"].iter().all(|f| {
                    replayed.get(*f).unwrap_or(&Bson::Null) == data.get(*f).unwrap_or(&Bson::Null)
                });
                if !same {
                    broken.push(format!(
                        "{key}: the events leave {replayed}, the record holds {data}"
                    ));
                }
            }
        }
    }
    for (id, _) in state {
        broken.push(format!("{id}: events of no record"));
    }
    if !broken.is_empty() {
        report.violations.push(format!(
            "{bot}: the change feed is not the records' log ({} problems), e.g. {:?}",
            broken.len(),
            &broken[..broken.len().min(3)]
        ));
    }
}

/// 3. Repeated requests ≤ interruptions × the in-flight cap. A listing page is due once per
///    pass that ran; a product page once, plus up to two more per change of that product (the
///    next pass's fetch, and one more if the change landed between its listing and its page)
///    and one for a deleted product (its page's 404); the rest repeat.
pub(super) async fn check_requests(
    run: &Run,
    bot: &str,
    shop: &Shop,
    mutated: &Mutated,
    report: &mut ChaosReport,
) {
    let Some(stats) = get_json(&format!("{}/__stats", shop.base)).await else {
        report
            .violations
            .push(format!("{bot}: the shop's stats could not be read"));
        return;
    };
    // Passes that ran (a refresh that lost its lock after preparing a pass skips a number).
    let passes = run.passes.get(bot).map_or(0, |p| p.len() as i64);
    report.passes.insert(bot.to_owned(), passes);
    let changed = mutated.changed.get(bot).cloned().unwrap_or_default();
    let deleted = mutated.deleted.get(bot).cloned().unwrap_or_default();
    let (mut total, mut repeated) = (0_u64, 0_u64);
    for (path, n) in stats["paths"].as_object().into_iter().flatten() {
        let n = n.as_u64().unwrap_or(0);
        if path == "/robots.txt" {
            continue; // read once by every process
        }
        total += n;
        let expected = match path.strip_prefix("/product/") {
            Some(sku) => {
                1 + 2 * u64::from(changed.get(sku).copied().unwrap_or(0))
                    + u64::from(deleted.contains(sku))
            }
            None => passes.max(0) as u64,
        };
        repeated += n.saturating_sub(expected);
    }
    report.requests.insert(bot.to_owned(), total);
    report.repeated.insert(bot.to_owned(), repeated);
    if repeated > report.repeat_bound() {
        report.violations.push(format!(
            "{bot}: {repeated} repeated requests exceed the bound {} ({} interruptions × {IN_FLIGHT_CAP})",
            report.repeat_bound(),
            report.interruptions()
        ));
    }
}

/// 4. Every bot ends Ready with the seeds of its last successful refresh; and whenever it was
///    seen ready, its seeds were one answer of its source (never a mix, never a stale
///    holder's).
pub(super) fn check_seeds(
    run: &Run,
    bots: &Bots,
    served: &HashMap<String, Vec<Served>>,
    report: &mut ChaosReport,
) {
    for bot in BOTS {
        let served = served.get(bot).cloned().unwrap_or_default();
        let answers: Vec<&Vec<String>> = served.iter().filter(|s| s.ok).map(|s| &s.seeds).collect();
        let Some(d) = bots.get(bot) else {
            report.violations.push(format!("{bot}: no document"));
            continue;
        };
        if !d.get_bool("isReady").unwrap_or(false) {
            report
                .violations
                .push(format!("{bot}: not ready at the end"));
        }
        let seeds = seeds_of(d);
        if answers.last().map(|a| same_set(a, &seeds)) != Some(true) {
            report.violations.push(format!(
                "{bot}: ends with seeds {seeds:?}, not its source's last answer {:?}",
                answers.last()
            ));
        }
        for seen in run.seen_seeds.get(bot).into_iter().flatten() {
            if !answers.iter().any(|a| same_set(a, seen)) {
                report.violations.push(format!(
                    "{bot}: was ready with seeds {seen:?}, which its source never answered"
                ));
            }
        }
    }
}

pub(super) fn same_set(a: &[String], b: &[String]) -> bool {
    let norm = |v: &[String]| {
        let mut v: Vec<String> = v
            .iter()
            .map(|s| s.trim_end_matches('/').to_owned())
            .collect();
        v.sort();
        v.dedup();
        v
    };
    norm(a) == norm(b)
}

/// 5. No panic and no unhandled error in any log; counts the leases lost.
pub(super) fn check_logs(run: &Run, report: &mut ChaosReport) {
    for inst in &run.instances {
        let path = run.cfg.dir.join(format!("{}.log", inst.name));
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                if line.contains("panicked") {
                    report
                        .violations
                        .push(format!("{}: panicked: {line}", inst.name));
                } else if !line.trim().is_empty() {
                    report.violations.push(format!(
                        "{}: a log line that is not JSON: {line}",
                        inst.name
                    ));
                }
                continue;
            };
            let message = v["fields"]["message"].as_str().unwrap_or("");
            match message {
                "edit lock lost; stopped without writing" => report.edit_locks_lost += 1,
                "url lease lost; the newer worker's result wins" => report.url_leases_lost += 1,
                _ => {}
            }
            if v["level"] == "ERROR" {
                report
                    .violations
                    .push(format!("{}: error logged: {line}", inst.name));
            }
        }
    }
}
