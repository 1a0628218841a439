#!/usr/bin/env node
// The `shoal` bin. Plain JS so that an old Node gets a clear message instead of a syntax error;
// everything else is TypeScript run by Node's built-in type stripping (Node >= 22.18 / 24).
const [major, minor] = process.versions.node.split('.').map(Number)
if (major < 22 || (major === 22 && minor < 18)) {
  process.stderr.write(`shoal: Node ${process.versions.node} is too old; shoal needs Node >= 22.18 (24 LTS recommended)\n`)
  process.exit(2)
}
const { main } = await import('./cli.ts')
process.exitCode = await main(process.argv.slice(2))
