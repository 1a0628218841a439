/**
 * docs/reference.md against the code, both ways, so the reference cannot drift: every command and
 * flag of the real commander program, every route the real ingress registers and every header it
 * sets, the error catalogue's codes with their statuses, every `/shoal/…` protocol id in the
 * source, every format/version constant, every environment variable the code reads. Something
 * new in the code fails here until the reference documents it; something the reference names that
 * the code no longer has fails too.
 */
import { readFile, readdir } from 'node:fs/promises'
import { join, relative } from 'node:path'
import type { Command } from 'commander'
import { describe, expect, it } from 'vitest'
import { buildProgram } from '../../scripts/cli.ts'
import { httpStatusOf } from '../../daemon/errors.ts'
import { MANIFEST_FORMAT } from '../../shards/contract.ts'
import { DASHBOARD_FORMAT } from '../../daemon/node/dashboard-view.ts'
import { LOG_HEAD_FORMAT, WITNESSED_HEADS_FORMAT } from '../../daemon/ledger/head.ts'
import { HEADS_WIRE_VERSION } from '../../daemon/witness/index.ts'
import { EXPERTS_WIRE_VERSION } from '../../daemon/experts/wire.ts'
import { KV_WIRE_VERSION } from '../../daemon/kv/wire.ts'
import { EXPERT_SHARDS_FORMAT } from '../../shards/expert-shards.ts'
import { COMPILER_VERSION } from '../../shards/compile.ts'
import { IR_VERSION } from '../../shards/graph/builder.ts'
import { FORMAT_VERSION } from '../../certs/schema.ts'
import { RECEIPT_FORMAT, RECEIPT_PART_FORMAT } from '../../daemon/ledger/receipt.ts'
import { STORE_FORMAT } from '../../daemon/ledger/store.ts'
import { CAPABILITY_RECORD_VERSION } from '../../daemon/mesh/wire/caps.ts'
import { WIRE_VERSION } from '../../daemon/mesh/wire/frame.ts'
import { INFER_WIRE_VERSION } from '../../daemon/routing/wire.ts'
import { STAGE_WIRE_VERSION } from '../../daemon/pipeline/wire.ts'
import { startHarness } from '../ingress/harness.ts'
import { DEFAULT_BUDGETS } from '../../daemon/node/config.ts'
import { DEFAULT_CHAIN_POLICY, DEFAULT_POLICY } from '../../daemon/routing/index.ts'
import { DEFAULT_TIMINGS } from '../../daemon/mesh/index.ts'
import { DEFAULT_INGRESS_LIMITS } from '../../daemon/ingress/index.ts'

const REPO = join(import.meta.dirname, '..', '..')
const doc = await readFile(join(REPO, 'docs', 'reference.md'), 'utf8')

/** The text of the section under a heading line, up to the next heading of the same or a higher level. */
function section (heading: string): string {
  const lines = doc.split('\n')
  const start = lines.findIndex(l => l === heading)
  if (start < 0) throw new Error(`docs/reference.md has no heading ${JSON.stringify(heading)}`)
  const level = /^#+/.exec(heading)![0].length
  const end = lines.findIndex((l, i) => i > start && /^#+ /.test(l) && /^#+/.exec(l)![0].length <= level)
  return lines.slice(start + 1, end < 0 ? undefined : end).join('\n')
}

/** First-column cells of the table rows in `text` that start with a backquoted value matching `re`. */
function firstCells (text: string, re: RegExp): string[] {
  return text.split('\n').flatMap(l => { const m = /^\| `([^`]+)`/.exec(l); return m !== null && re.test(m[1]!) ? [m[1]!] : [] })
}

async function sourceFiles (dir: string, out: string[] = []): Promise<string[]> {
  for (const e of await readdir(join(REPO, dir), { withFileTypes: true })) {
    const p = join(dir, e.name)
    if (e.isDirectory()) await sourceFiles(p, out)
    else if (/\.(ts|mjs)$/.test(e.name) && !e.name.endsWith('.d.mts')) out.push(p)
  }
  return out
}
const SOURCES = await Promise.all([...await sourceFiles('daemon'), ...await sourceFiles('certs'), ...await sourceFiles('shards'), ...await sourceFiles('scripts')]
  .map(async p => ({ path: p, text: await readFile(join(REPO, p), 'utf8') })))

describe('docs/reference.md: CLI', () => {
  const program = buildProgram()
  const leaves: Array<{ name: string, command: Command }> = [{ name: 'shoal', command: program }]
  const walk = (c: Command, prefix: string): void => {
    for (const sub of c.commands) {
      const name = `${prefix} ${sub.name()}`
      if (sub.commands.length > 0) walk(sub, name)
      else leaves.push({ name, command: sub })
    }
  }
  walk(program, 'shoal')

  it('has a section per command whose flag table lists exactly its flags', () => {
    for (const { name, command } of leaves) {
      const text = section(`### \`${name}\``)
      const documented = firstCells(text, /^(-\w, )?--/).map(c => /--[a-z0-9-]+/.exec(c)![0]).sort()
      const actual = command.options.map(o => o.long!).filter(f => f !== '--help').sort()
      expect(documented, name).toEqual(actual)
    }
  })

  it('documents no command the program lacks', () => {
    const headings = [...doc.matchAll(/^### `(shoal[a-z -]*)`$/gm)].map(m => m[1]!)
    expect(headings.sort()).toEqual(leaves.map(l => l.name).sort())
  })

  it('names the same defaults as --help', () => {
    for (const { name, command } of leaves) {
      const rows = section(`### \`${name}\``).split('\n')
      for (const o of command.options) {
        if (typeof o.defaultValue !== 'string') continue
        const row = rows.find(r => r.startsWith(`| \`${o.flags}\``))
        expect(row, `${name} ${o.flags}`).toBeDefined()
        expect(row!.split('|')[2]!.trim(), `${name} ${o.flags} default`).toBe(`\`${o.defaultValue}\``)
      }
    }
  })

  it('lists every environment variable the code reads', () => {
    const read = new Set(SOURCES.flatMap(s => [...s.text.matchAll(/process\.env\.([A-Z_]+)/g)].map(m => m[1]!)).filter(v => v !== 'PATH'))
    const documented = firstCells(section('### Environment'), /^[A-Z_]+$/)
    expect(documented.sort()).toEqual([...read].sort())
  })
})

describe('docs/reference.md: HTTP', () => {
  it('lists exactly the routes the ingress registers, and the headers a completion carries', async () => {
    const h = await startHarness({}, {}, { mesh: { snapshot: () => ({ self: {}, peers: [] }) as never }, receipts: { get: async () => undefined }, dashboard: { state: async () => ({}), verify: async () => undefined } })
    try {
      const routes = [...h.ingress.app.printRoutes({ commonPrefix: false }).matchAll(/── (\S+) \(([^)]+)\)/g)]
        .flatMap(m => m[2]!.split(', ').filter(method => method !== 'HEAD').map(method => `${method} ${m[1]!.startsWith('/') ? m[1]! : `/${m[1]!}`}`))
      const table = section('## HTTP API').split('\n').flatMap(l => { const m = /^\| `([A-Z]+)` \| `([^`]+)` \|/.exec(l); return m === null ? [] : [`${m[1]} ${m[2]}`] })
      expect(table.sort()).toEqual(routes.sort())

      const res = await fetch(`${h.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'sim', prompt: 'hi', max_tokens: 2 }) })
      expect(res.status).toBe(200)
      const headers = firstCells(section('## HTTP API'), /^[a-z]+(-[a-z]+)+$/)
      for (const [name] of res.headers) if (name.startsWith('x-')) expect(headers, name).toContain(name)
    } finally {
      await h.stop()
    }
  })

  it('lists every header the ingress sets', () => {
    const headers = firstCells(section('## HTTP API'), /^[a-z]+(-[a-z]+)+$/)
    const set = new Set(SOURCES.filter(s => s.path.startsWith('daemon/ingress/')).flatMap(s => [
      ...[...s.text.matchAll(/header\('([a-z-]+)'/g)].map(m => m[1]!),
      ...[...s.text.matchAll(/'((?:x|content-security)-[a-z-]+)':/g)].map(m => m[1]!),
    ]))
    set.delete('connection') // `connection: close` while stopping: HTTP's own
    for (const name of set) expect(headers, name).toContain(name)
    expect(headers.sort()).toEqual([...set].sort())
  })

  it('lists every error code with the status and type the catalogue maps it to', async () => {
    const catalogue = await readFile(join(REPO, 'daemon', 'errors.ts'), 'utf8')
    const codes = [...catalogue.matchAll(/^\s+(SHOAL_ERR_[A-Z_]+): \[/gm)].map(m => m[1]!)
    const rows = section('## HTTP API').split('\n').flatMap(l => {
      const m = /^\| `(SHOAL_ERR_[A-Z_]+)` \| (\d+) \| `([a-z_]+)` \|/.exec(l)
      return m === null ? [] : [{ code: m[1]!, status: Number(m[2]), type: m[3]! }]
    })
    expect(rows.map(r => r.code).sort()).toEqual(codes.sort())
    for (const r of rows) expect(httpStatusOf({ code: r.code }), r.code).toEqual({ status: r.status, type: r.type })
  })
})

describe('docs/reference.md: formats and protocols', () => {
  it('lists every /shoal/ protocol id and topic in the source, and no other', () => {
    const ids = new Set(SOURCES.flatMap(s => [...s.text.matchAll(/'(\/shoal\/[a-z-]+\/[0-9.]+)'/g)].map(m => m[1]!)))
    const documented = firstCells(section('## Wire protocols'), /^\/shoal\//)
    expect(documented.sort()).toEqual([...ids].sort())
  })

  it('gives every format its current version', () => {
    const versions: Array<[string, string | number]> = [
      ['shard manifest', MANIFEST_FORMAT],
      ['shard compiler', COMPILER_VERSION],
      ['certificates and revocation lists', FORMAT_VERSION],
      ['receipt (', RECEIPT_FORMAT],
      ['receipt part', RECEIPT_PART_FORMAT],
      ['receipt log store', STORE_FORMAT],
      ['capability record', CAPABILITY_RECORD_VERSION],
      ['mesh frames', WIRE_VERSION],
      ['infer frames', INFER_WIRE_VERSION],
      ['stage frames', STAGE_WIRE_VERSION],
      ['dashboard state', DASHBOARD_FORMAT],
      ['signed log head', LOG_HEAD_FORMAT],
      ['witnessed heads file', WITNESSED_HEADS_FORMAT],
      ['heads frames', HEADS_WIRE_VERSION],
      ['experts frames', EXPERTS_WIRE_VERSION],
      ['kv frames', KV_WIRE_VERSION],
      ['expert shards', EXPERT_SHARDS_FORMAT],
    ]
    const rows = section('## Versions').split('\n').filter(l => l.startsWith('| ') && !l.startsWith('| what') && !l.startsWith('|---'))
    expect(rows).toHaveLength(versions.length)
    for (const [label, value] of versions) {
      const row = rows.find(r => r.startsWith(`| ${label}`))
      expect(row, label).toBeDefined()
      expect(row!.split('|')[2]!.trim(), label).toBe(`\`${value}\``)
    }
    expect(section('## On disk')).toContain(`ONNX IR ${IR_VERSION}`)
  })

  it('knows every exported version or format constant (documented above, or internal on purpose)', () => {
    const documented = ['MANIFEST_FORMAT', 'COMPILER_VERSION', 'FORMAT_VERSION', 'RECEIPT_FORMAT', 'RECEIPT_PART_FORMAT', 'STORE_FORMAT',
      'CAPABILITY_RECORD_VERSION', 'WIRE_VERSION', 'INFER_WIRE_VERSION', 'STAGE_WIRE_VERSION', 'IR_VERSION', 'DASHBOARD_FORMAT', 'LOG_HEAD_FORMAT', 'WITNESSED_HEADS_FORMAT', 'HEADS_WIRE_VERSION', 'EXPERTS_WIRE_VERSION', 'KV_WIRE_VERSION', 'EXPERT_SHARDS_FORMAT']
    // The worker_threads message protocol is inside one process: both ends always ship together.
    const internal = ['ENGINE_PROTOCOL_VERSION']
    const exported = SOURCES.flatMap(s => [...s.text.matchAll(/^export const ([A-Z_]*(?:VERSION|FORMAT)) = /gm)].map(m => `${m[1]!} (${relative(REPO, join(REPO, s.path))})`))
    for (const e of exported) expect([...documented, ...internal], e).toContain(e.split(' ')[0])
  })
})

describe('docs/reference.md: settings without flags', () => {
  it('documents every key of each DaemonConfig section with its default', () => {
    const text = section('## Embedding: the daemon\'s settings without flags')
    const tables: Array<[string, Readonly<Record<string, number>>]> = [
      ['budgets', DEFAULT_BUDGETS], ['routing.replica', DEFAULT_POLICY], ['routing.chain', DEFAULT_CHAIN_POLICY],
      ['meshTimings', DEFAULT_TIMINGS], ['ingress', DEFAULT_INGRESS_LIMITS],
    ]
    for (const [name, defaults] of tables) {
      // The table after the section's bold name, up to the next blank line after it.
      const start = text.indexOf(`**\`${name}\`**`)
      expect(start, name).toBeGreaterThanOrEqual(0)
      const rows = text.slice(start).split('\n\n')[1]!.split('\n')
        .flatMap(l => { const m = /^\| `([a-zA-Z]+)` \| `([0-9.]+)` \|/.exec(l); return m === null ? [] : [[m[1]!, Number(m[2])] as const] })
      expect(Object.fromEntries(rows), name).toEqual({ ...defaults })
    }
  })
})

describe('the repository links what it cites', () => {
  it('README links the reference; no source cites a notes file that is not in the repository', async () => {
    const readme = await readFile(join(REPO, 'README.md'), 'utf8')
    expect(readme).toContain('(docs/reference.md)')
    expect(readme).not.toMatch(/contract the project follows/)
    const docs = new Set(await readdir(join(REPO, 'docs')))
    for (const s of SOURCES) {
      for (const m of s.text.matchAll(/\b([a-z][a-z0-9-]*-notes\.md)\b/g)) {
        expect(s.text.includes(`docs/${m[1]!}`) && docs.has(m[1]!), `${s.path} cites ${m[1]!}`).toBe(true)
      }
    }
  })
})
