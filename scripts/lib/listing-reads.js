// The listing reads of a pass's start and end, as the frontier's two index designs answer them:
// `before`, `bot_pass_listings` = {botId, pass} with the partial filter `kind: {$in: [...]}`, read
// with a hint (the earlier design); `now`, {kind, botId, pass} with `kind: {$gt: "detail"}`,
// read with no hint, one query per listing kind. ENTRIES detail entries and LISTINGS listing
// entries of one bot, in one pass. Called by scripts/bench/listing-reads.
const entries = Number(process.env.ENTRIES || 200000), listings = Number(process.env.LISTINGS || 2000);
const rounds = Number(process.env.ROUNDS || 3);
const d = db.getSiblingDB("bench_listing_reads"); d.dropDatabase();
function fill(c) {
  let batch = [];
  for (let i = 0; i < entries + listings; i++) {
    const kind = i < entries ? "detail" : i === entries ? "seed" : "list";
    batch.push({_id: "e" + i, botId: "shop", kind, pass: 2, status: "done", doneAt: new Date(), host: "h", priority: kind === "detail" ? 0 : 1, slot: i % 1024, url: "http://h/" + i});
    if (batch.length === 5000) { c.insertMany(batch); batch = []; }
  }
  if (batch.length) c.insertMany(batch);
  c.createIndex({botId: 1, pass: 1, status: 1, host: 1, priority: 1, slot: 1}, {name: "bot_pass_status_host_priority_slot"});
}
const before = d.before, now = d.now;
fill(before); fill(now);
before.createIndex({botId: 1, pass: 1}, {name: "bot_pass_listings", partialFilterExpression: {kind: {$in: ["list", "seed"]}}});
now.createIndex({kind: 1, botId: 1, pass: 1}, {name: "bot_pass_listings", partialFilterExpression: {kind: {$gt: "detail"}}});
const kinds = {kind: {$in: ["list", "seed"]}};
const perKind = (c, pass) => ["list", "seed"].reduce((n, kind) => n + c.find({kind, botId: "shop", pass}).toArray().length, 0);
const reads = [
  ["listing entries of earlier passes",
    () => before.find({botId: "shop", pass: {$lt: 3}, ...kinds, status: "done"}).hint("bot_pass_listings").toArray().length,
    () => perKind(now, {$lt: 3})],
  ["one pass's listing entries",
    () => before.find({botId: "shop", ...kinds, pass: 2}).hint("bot_pass_listings").toArray().length,
    () => perKind(now, {$eq: 2})],
  // (These entries carry no manifest: the old filter asks `$exists: false` to read the same rows.)
  ["every manifest",
    () => before.find({botId: "shop", ...kinds, listedPass: {$exists: false}}).hint("bot_pass_listings").toArray().length,
    () => perKind(now, {$gte: 0})],
  ["highest-pass probe (none above)",
    () => before.find({botId: "shop", pass: {$gt: 2}}).hint("bot_pass_status_host_priority_slot").limit(1).toArray().length,
    () => now.find({botId: "shop", pass: {$gte: 3}}).limit(1).toArray().length],
];
function ms(f) { const t = Date.now(); const n = f(); return [Date.now() - t, n]; }
print(`${entries} detail entries, ${listings} listing entries; ${rounds} rounds, ms (rows)`);
print("| read | before: hinted, `$in` partial filter | now: no hint, {kind, botId, pass} |");
print("|---|---|---|");
for (const [name, old, cur] of reads) {
  const a = [], b = [];
  for (let r = 0; r < rounds; r++) { a.push(ms(old)); b.push(ms(cur)); }
  if (a.some(([, n]) => n !== a[0][1]) || b.some(([, n]) => n !== a[0][1])) { print(`rows differ for ${name}`); quit(1); }
  const fmt = (xs) => xs.map(([t]) => t).join(" / ") + ` (${xs[0][1]})`;
  print(`| ${name} | ${fmt(a)} | ${fmt(b)} |`);
}
d.dropDatabase();
