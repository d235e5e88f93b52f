// Bundles src/main.ts (and uPlot's CSS) into dist/, next to a copy of index.html.
import { copyFile, mkdir } from "node:fs/promises";
import * as esbuild from "esbuild";

await mkdir("dist", { recursive: true });
await esbuild.build({
  entryPoints: { app: "src/main.ts" },
  bundle: true,
  format: "esm",
  target: "es2022",
  minify: true,
  sourcemap: true,
  outdir: "dist",
  logLevel: "warning",
});
await copyFile("index.html", "dist/index.html");
