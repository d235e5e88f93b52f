// Validates custom resources against their CRDs' schemas, with the models of
// kubernetes-models-ts (@kubernetes-models/prometheus-operator, cert-manager, keda): each
// model's validate() runs the schema of its CRD, compiled by ajv, and throws on a violation.
//
//   node validate.mjs objects.json      (or the JSON on stdin)
//
// Input: a JSON list of objects. Output: a line per object, "ok <kind>/<name>" or
// "FAIL <kind>/<name>: <what is wrong>"; exit status 1 when any object fails (an apiVersion
// and kind without a model here fails too), 2 when the input is not a JSON list of objects.
// Like the API server, the schemas do not refuse a field they do not know (the server prunes
// it): a misspelt field passes.
//
// The models (6.x, keda 2.x) declare Node.js 22+; they run on the Node.js 20 of the project's
// machines (npm ci's EBADENGINE warnings are hidden by make setup's --loglevel=error), and the
// chart test proves it on every run: valid objects pass, wrong ones fail with their paths.
import { readFileSync } from "node:fs";

// apiVersion/kind -> the model's module; the class is named after the kind.
const MODELS = {
  "monitoring.coreos.com/v1/ServiceMonitor":
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor",
  "monitoring.coreos.com/v1/PrometheusRule":
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule",
  "cert-manager.io/v1/Certificate": "@kubernetes-models/cert-manager/cert-manager.io/v1/Certificate",
  "keda.sh/v1alpha1/ScaledObject": "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject",
};

function describe(error) {
  // ajv's errors, one per violation, each with the path in the object it concerns.
  if (!Array.isArray(error.errors) || error.errors.length === 0) return error.message;
  return error.errors
    .map((e) => {
      const allowed = e.params?.allowedValues ? ` (${e.params.allowedValues.join(", ")})` : "";
      return `${e.instancePath || "/"} ${e.message}${allowed}`;
    })
    .join("; ");
}

async function check(object) {
  const key = `${object?.apiVersion}/${object?.kind}`;
  const module = MODELS[key];
  if (!module) return `no schema for ${key} (known: ${Object.keys(MODELS).join(", ")})`;
  const Model = (await import(module))[object.kind];
  try {
    new Model(object).validate();
    return null;
  } catch (error) {
    return describe(error);
  }
}

let objects;
try {
  objects = JSON.parse(readFileSync(process.argv[2] ?? 0, "utf8"));
} catch (error) {
  console.error(`cannot read a JSON list of objects: ${error.message}`);
  process.exit(2);
}
if (!Array.isArray(objects)) {
  console.error("the input is not a JSON list of objects");
  process.exit(2);
}
let failed = 0;
for (const object of objects) {
  const name = `${object?.kind}/${object?.metadata?.name ?? "<no name>"}`;
  const problem = await check(object);
  if (problem === null) {
    console.log(`ok ${name}`);
  } else {
    failed += 1;
    console.log(`FAIL ${name}: ${problem}`);
  }
}
if (failed) console.log(`${failed} of ${objects.length} objects fail their schema`);
process.exit(failed ? 1 : 0);
