#!/usr/bin/env node
// The `shoal` bin. Plain JS that parses on any Node >= 18: on a Node older than package.json's
// engines.node it re-runs itself with Node 24 from .toolchain/ (fetched from the npm registry on
// first use; scripts/toolchain.mjs says so in one line). Everything else is TypeScript run by
// Node's built-in type stripping. The commands that run an engine re-execute once with glibc malloc
// settings (scripts/malloc.mjs).
import module from 'node:module'
import { fileURLToPath } from 'node:url'
import { execWithMallocTunables } from './malloc.mjs'
import { isNewEnough, modernNode, runWith } from './toolchain.mjs'

/**
 * Node's on-disk compile cache (each module's V8 code, and a TypeScript file's stripped source,
 * keyed by content; Node's default directory under the temp dir, or NODE_COMPILE_CACHE): a later
 * start strips and compiles none of the ~1,500 modules again. Set in the environment too, so the
 * malloc re-execution and the engine's worker threads use it. NODE_DISABLE_COMPILE_CACHE=1 turns
 * it off.
 */
function enableCompileCache () {
  const { directory } = module.enableCompileCache?.() ?? {}
  if (directory !== undefined) process.env.NODE_COMPILE_CACHE = directory
}

if (isNewEnough(process.versions.node)) {
  enableCompileCache()
  execWithMallocTunables(fileURLToPath(import.meta.url), process.argv.slice(2))
  const { main } = await import('./cli.ts')
  process.exitCode = await main(process.argv.slice(2))
} else {
  let node
  try {
    node = modernNode()
  } catch (err) {
    process.stderr.write(`shoal: ${err.message}\n`)
    process.exit(2)
  }
  runWith(node, [node, fileURLToPath(import.meta.url), ...process.argv.slice(2)])
}
