// Validates ServiceMonitor/PodMonitor objects against prometheus-operator's
// schemas (the npm package @kubernetes-models/prometheus-operator, which
// scripts/install-packages.sh puts in .tools/). Reads a JSON array of
// objects on stdin; prints one line per object; exits 1 if any is invalid.
//
//   node tests/tools/validate-monitors.mjs .tools < objects.json
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const tools = process.argv[2];
if (!tools) {
  console.error('usage: validate-monitors.mjs <tools dir> < objects.json');
  process.exit(2);
}
const v1 = path.resolve(tools, 'node_modules/@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1');
const kinds = {};
for (const kind of ['ServiceMonitor', 'PodMonitor']) {
  kinds[kind] = (await import(pathToFileURL(path.join(v1, `${kind}.js`)).href))[kind];
}
let bad = 0;
for (const obj of JSON.parse(fs.readFileSync(0, 'utf8'))) {
  const name = `${obj.kind}/${obj.metadata?.name}`;
  if (obj.apiVersion !== 'monitoring.coreos.com/v1' || !kinds[obj.kind]) {
    console.log(`unknown ${name} (${obj.apiVersion})`);
    bad++;
    continue;
  }
  try {
    new kinds[obj.kind](obj).validate();
    console.log(`valid ${name}`);
  } catch (e) {
    console.log(`invalid ${name}: ${e.message}`);
    bad++;
  }
}
process.exit(bad ? 1 : 0);
