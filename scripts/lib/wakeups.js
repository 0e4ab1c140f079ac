// Wake-ups a fleet's heartbeats cost: BOTS bot documents whose locks are all held and renewed
// ROUNDS times (one update statement a lock, as the hub sends them), plus CHANGES writes that
// change a decision (a refresh request), watched through two change streams on `bots`: the one
// an instance opened without a filter, and seedlock's (heartbeats filtered out on the server).
// Every event a stream delivers wakes a runner on every instance. Called by scripts/bench/wakeups.
const bots = Number(process.env.BOTS || 1000);
const rounds = Number(process.env.ROUNDS || 3);
const changes = Number(process.env.CHANGES || 10);
const d = db.getSiblingDB("seedlock_bench_wakeups");
d.dropDatabase();
const col = d.bots;
const docs = [];
for (let i = 0; i < bots; i++) {
  docs.push({ _id: `b${i}`, isReady: false, isEditing: true, editingBy: "bench", lockEpoch: 1,
              heartbeatAt: new Date(), lockExpiresAt: new Date(), seeds: [] });
}
col.insertMany(docs);
const project = { $project: { operationType: 1, documentKey: 1, "updateDescription.updatedFields.specVersion": 1 } };
const filter = { $match: { $or: [
  { operationType: { $ne: "update" } },
  { "updateDescription.removedFields.0": { $exists: true } },
  { $expr: { $gt: [{ $size: { $setDifference: [
    { $map: { input: { $objectToArray: { $ifNull: ["$updateDescription.updatedFields", {}] } }, in: "$$this.k" } },
    ["heartbeatAt", "lockExpiresAt"] ] } }, 0] } },
] } };
const unfiltered = col.watch([project]);
const filtered = col.watch([filter, project]);
const started = Date.now();
for (let r = 0; r < rounds; r++) {
  const ops = [];
  for (let i = 0; i < bots; i++) {
    ops.push({ updateOne: {
      filter: { _id: `b${i}`, isEditing: true, editingBy: "bench", lockEpoch: 1 },
      update: { $set: { lockExpiresAt: new Date(Date.now() + 30000) }, $currentDate: { heartbeatAt: true } },
    } });
  }
  col.bulkWrite(ops, { ordered: false });
}
for (let i = 0; i < changes; i++) {
  col.updateOne({ _id: `b${i}` }, { $currentDate: { refreshRequestedAt: true } });
}
const written = Date.now() - started;
function drain(stream) {
  let n = 0, idle = 0;
  while (idle < 3) {
    if (stream.tryNext()) { n++; idle = 0; } else { idle++; sleep(200); }
  }
  return n;
}
const before = drain(unfiltered);
const after = drain(filtered);
d.dropDatabase();
const heartbeat = 10; // lock.heartbeat at the default lock.ttl (30 s) / 3
print(`| bots | heartbeat rounds | decision writes | events, no filter | events, heartbeats filtered | wake-ups/s at lock.heartbeat ${heartbeat} s, no filter | filtered |`);
print("|---|---|---|---|---|---|---|");
print(`| ${bots} | ${rounds} | ${changes} | ${before} | ${after} | ${(bots / heartbeat).toFixed(0)} | ${(Math.max(0, after - changes) / rounds / heartbeat).toFixed(0)} |`);
print(`(written in ${written} ms; each instance's stream delivers every event, so the wake-ups are per instance)`);
