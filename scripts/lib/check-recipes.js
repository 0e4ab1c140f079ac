// Runs every statement of the README's "mongosh recipes" block through `explain` and fails on a
// collection scan (and on a recipe that works on its answer in the shell answering nothing).
// Called by scripts/check-recipes with RECIPES_DB (the crawled database) and README (the file to
// read).
const target = db.getSiblingDB(process.env.RECIPES_DB);
const text = fs.readFileSync(process.env.README, 'utf8');
const section = text.split('### mongosh recipes')[1];
if (!section) throw new Error('README has no "### mongosh recipes" section');
const block = section.split('```js')[1].split('```')[0];

// Statements: a line starting with `db.` opens one; indented lines continue it.
const recipes = [];
let comment = '';
for (const line of block.split('\n')) {
  if (line.startsWith('//')) { comment = line.replace(/^\/\/\s*/, ''); continue; }
  if (line.startsWith('db.')) { recipes.push({ comment, code: line }); continue; }
  if (/^\s+\S/.test(line) && recipes.length) { recipes[recipes.length - 1].code += '\n' + line; continue; }
  if (line.trim() && !line.startsWith('use ')) throw new Error(`cannot read recipe line: ${line}`);
}

// Each recipe becomes an explain of itself, written to a file that mongosh loads (so the shell's
// own rewriting makes lookups inside a recipe, `db.bots.findOne(...)`, return their documents):
//   db.C.find(...)[.sort(...)]  →  the same (without a `.toArray()…` tail), then .explain("queryPlanner")
//   db.C.aggregate(...)         →  db.C.explain("queryPlanner").aggregate(...)
//   db.C.updateOne(F, U)        →  db.C.explain("queryPlanner").update(F, U)  (one document, as updateOne)
const lines = [`db = db.getSiblingDB(${JSON.stringify(process.env.RECIPES_DB)});`];
recipes.forEach((r, i) => {
  const code = r.code.replace(/\s{2,}\/\/[^\n]*$/, '');
  const m = code.match(/^db\.(\w+)\.(find|aggregate|updateOne)\(/);
  if (!m) throw new Error(`no explain for recipe: ${code}`);
  const [head, coll, method] = m;
  let explained;
  // A find may work on its answer in the shell (`.toArray().filter(…)`): its query is explained.
  if (method === 'find') explained = `${code.split(/\s*\.toArray\(\)/)[0]}.explain("queryPlanner")`;
  else if (method === 'aggregate') explained = `db.${coll}.explain("queryPlanner").aggregate(${code.slice(head.length)}`;
  else explained = `db.${coll}.explain("queryPlanner").update(${code.slice(head.length)}`;
  lines.push(`explained[${i}] = ${explained};`);
  // One that works on its answer in the shell is also run: on the crawled shop it finds something
  // (a recipe that reads a field the wrong way answers nothing).
  if (method === 'find' && /\.toArray\(\)/.test(code)) lines.push(`answered[${i}] = (${code}).length;`);
});
const explained = [];
const answered = [];
globalThis.explained = explained;
globalThis.answered = answered;
const generated = `${process.env.TMPDIR || '/tmp'}/seedlock-recipes-${process.pid}.js`;
fs.writeFileSync(generated, lines.join('\n') + '\n');
try { load(generated); } finally { fs.unlinkSync(generated); }

// Every stage of every winning plan (rejected plans do not run).
function winningStages(node, out, inWinning) {
  if (Array.isArray(node)) { node.forEach((n) => winningStages(n, out, inWinning)); return out; }
  if (!node || typeof node !== 'object') return out;
  for (const [key, value] of Object.entries(node)) {
    if (key === 'rejectedPlans') continue;
    const winning = inWinning || key === 'winningPlan';
    if (winning && key === 'stage' && typeof value === 'string') {
      out.push({ stage: value, index: node.indexName });
    }
    winningStages(value, out, winning);
  }
  return out;
}

let failed = 0;
recipes.forEach((r, i) => {
  const stages = winningStages(explained[i], [], false);
  const indexes = [...new Set(stages.filter((s) => s.index).map((s) => s.index))];
  const byId = stages.some((s) => ['IDHACK', 'EXPRESS_IXSCAN', 'CLUSTERED_IXSCAN'].includes(s.stage));
  const scans = stages.some((s) => s.stage === 'COLLSCAN');
  const ok = !scans && (indexes.length > 0 || byId) && answered[i] !== 0;
  if (!ok) failed += 1;
  const plan = [...new Set(stages.map((s) => s.stage))].join(' ← ');
  const head = r.code.split('\n')[0].slice(0, 90);
  if (answered[i] === 0) print(`EMPTY: the recipe answered nothing on the crawled shop`);
  print(`${ok ? 'ok  ' : answered[i] === 0 ? 'NONE' : 'SCAN'} ${(indexes.join(', ') || (byId ? '_id' : '-')).padEnd(36)} ${plan.padEnd(28)} ${head}`);
});
print(`${recipes.length} recipes, ${failed} without an index or an answer`);
if (recipes.length < 10) { print('fewer recipes than expected: the README block was not read'); quit(1); }
if (failed) quit(1);
