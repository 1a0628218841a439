/**
 * `shoal ca init|issue|revoke|list`: thin wrappers over certs/. Options arrive from commander as
 * strings; CA and certificate errors become ExitError (exit 2) with their one-line message.
 */
import { resolve } from 'node:path'
import { initCa, issueKey, issueNode, listKeys, listNodes, revokeNode } from '../../certs/index.ts'
import type { Role } from '../../certs/index.ts'
import { ExitError } from '../exit-error.ts'

type Options = Record<string, unknown>

function text (opts: Options, key: string): string {
  const value = opts[key]
  if (typeof value !== 'string' || value === '') throw new ExitError(`--${key} needs a value`)
  return value
}

/** Expected failures (typed errors with a SHOAL_ERR_CA_/SHOAL_ERR_CERT_ code) exit 2 with one line. */
async function run<T> (fn: () => Promise<T>): Promise<T> {
  try {
    return await fn()
  } catch (err) {
    const code = (err as { code?: unknown } | null)?.code
    if (typeof code === 'string' && /^SHOAL_ERR_(CA|CERT)_/.test(code)) {
      throw new ExitError(String((err as Error).message).split('\n')[0] ?? code)
    }
    throw err
  }
}

function days (value: unknown): number {
  const s = typeof value === 'string' ? value : '365'
  if (!/^\d{1,5}$/.test(s)) throw new ExitError(`--days must be a whole number of days, got ${JSON.stringify(s)}`)
  return Number(s)
}

function roles (value: unknown): Role[] {
  const s = typeof value === 'string' ? value : 'ingress,worker'
  return s.split(',').map((r) => r.trim()) as Role[] // certs checks the names
}

export async function caInit (opts: Options): Promise<void> {
  const dir = resolve(text(opts, 'dir'))
  const cert = await run(async () => await initCa(dir))
  process.stdout.write(`created CA ${cert.body.name} in ${dir} (key id ${cert.body.keyId})\n`)
}

export async function caIssue (opts: Options): Promise<void> {
  const dir = resolve(text(opts, 'dir'))
  const { peerId } = await run(async () => await issueNode(dir, {
    name: text(opts, 'name'), outDir: resolve(text(opts, 'out')), days: days(opts.days), roles: roles(opts.roles),
  }))
  process.stdout.write(`${peerId}\n`)
}

export async function caKey (opts: Options): Promise<void> {
  const dir = resolve(text(opts, 'dir'))
  const name = text(opts, 'name')
  const { token, key } = await run(async () => await issueKey(dir, { name, days: days(opts.days) }))
  // The token is the bearer secret: shown once, never stored by the CA. Last line = the key alone.
  process.stdout.write(`client key ${name} (serial ${key.body.serial}), valid until ${key.body.notAfter}; pass it as the OpenAI client's apiKey (Authorization: Bearer):\n${token}\n`)
}

export async function caRevoke (opts: Options): Promise<void> {
  const dir = resolve(text(opts, 'dir'))
  const name = text(opts, 'name')
  const list = await run(async () => await revokeNode(dir, name))
  process.stdout.write(`revoked ${name}; revocation list #${list.body.number} (${list.body.revoked.length} revoked) in ${dir}\n`)
}

export async function caList (opts: Options): Promise<void> {
  const dir = resolve(text(opts, 'dir'))
  const nodes = await run(async () => await listNodes(dir))
  const keys = await run(async () => await listKeys(dir))
  const rows = [['NAME', 'PEER ID', 'SERIAL', 'ROLES', 'EXPIRES', 'REVOKED']]
  for (const n of nodes) rows.push([n.name, n.peerId, n.serial, n.roles.join(','), n.notAfter, n.revoked ? 'yes' : 'no'])
  // Client keys have no peer id; their "role" says what they are.
  for (const k of keys) rows.push([k.name, '-', k.serial, 'client-key', k.notAfter, k.revoked ? 'yes' : 'no'])
  const widths = rows[0]!.map((_, i) => Math.max(...rows.map((r) => r[i]!.length)))
  process.stdout.write(rows.map((r) => r.map((cell, i) => cell.padEnd(widths[i]!)).join('  ').trimEnd()).join('\n') + '\n')
}
