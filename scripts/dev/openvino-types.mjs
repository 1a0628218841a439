#!/usr/bin/env node
// Makes openvino-node's own type declarations available to `tsc` where the package is not
// installed (its install step downloads a native runtime from a host CI cannot reach). It packs the
// registry tarball of the version package.json pins (`npm pack` runs no install script) and
// extracts only package.json and types/*.d.ts into .cache/openvino-node-types/, which tsconfig's
// `paths` falls back to after node_modules/openvino-node.
import { execFileSync } from 'node:child_process'
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { gunzipSync } from 'node:zlib'

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..')
const pkg = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8'))
const spec = pkg.optionalDependencies?.['openvino-node']
const outDir = join(root, '.cache', 'openvino-node-types')
const stamp = join(outDir, '.spec')

if (spec === undefined) {
  console.log('openvino-types: package.json has no optionalDependencies["openvino-node"]; nothing to do')
} else if (existsSync(join(root, 'node_modules', 'openvino-node', 'types', 'index.d.ts'))) {
  console.log('openvino-types: node_modules/openvino-node is installed; using its declarations')
} else if (existsSync(stamp) && readFileSync(stamp, 'utf8') === spec) {
  console.log(`openvino-types: cached declarations for openvino-node@${spec}`)
} else {
  try {
    fetchTypes(spec)
  } catch (err) {
    console.error(`openvino-types: could not fetch openvino-node@${spec} declarations (needs the npm registry): ${err.message}`)
    process.exit(1)
  }
}

function fetchTypes (spec) {
  const tmp = mkdtempSync(join(tmpdir(), 'openvino-types-'))
  try {
    const out = npm(['pack', `openvino-node@${spec}`, '--pack-destination', tmp, '--json', '--ignore-scripts'])
    const [{ filename, version }] = JSON.parse(out)
    const tarball = readFileSync(join(tmp, filename))
    rmSync(outDir, { recursive: true, force: true })
    let count = 0
    for (const { name, body } of untar(gunzipSync(tarball))) {
      const rel = name.replace(/^package\//, '')
      if (rel === 'package.json' || /^types\/[\w./-]+\.d\.ts$/.test(rel)) {
        const dest = join(outDir, rel)
        mkdirSync(dirname(dest), { recursive: true })
        writeFileSync(dest, body)
        count++
      }
    }
    if (count < 2) throw new Error(`openvino-node@${version}: tarball had no types/*.d.ts`)
    writeFileSync(stamp, spec)
    console.log(`openvino-types: extracted ${count} files of openvino-node@${version} into .cache/openvino-node-types`)
  } finally {
    rmSync(tmp, { recursive: true, force: true })
  }
}

function npm (args) {
  // Under `npm run`, npm_execpath is npm's own CLI script: run it with this node (works on Windows too).
  const execPath = process.env.npm_execpath
  if (execPath !== undefined && /npm-cli\.js$/.test(execPath)) {
    return execFileSync(process.execPath, [execPath, ...args], { encoding: 'utf8' })
  }
  return execFileSync('npm', args, { encoding: 'utf8', shell: process.platform === 'win32' })
}

/** Minimal ustar reader: regular files only. */
function * untar (buf) {
  for (let off = 0; off + 512 <= buf.length;) {
    const header = buf.subarray(off, off + 512)
    if (header.every(b => b === 0)) return
    const str = (a, b) => header.subarray(a, b).toString('utf8').replace(/\0.*$/s, '')
    const size = parseInt(str(124, 136).trim() || '0', 8)
    const prefix = str(345, 500)
    const name = prefix ? `${prefix}/${str(0, 100)}` : str(0, 100)
    const type = String.fromCharCode(header[156] || 48)
    off += 512
    if (type === '0' || type === '\0') yield { name, body: buf.subarray(off, off + size) }
    off += Math.ceil(size / 512) * 512
  }
}
