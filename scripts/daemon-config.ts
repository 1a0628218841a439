/** CLI flags → a validated daemon config; config errors become exit-2 one-liners. */
import { ExitError } from './exit-error.ts'
import type { DaemonConfig } from '../daemon/node/index.ts'

export async function configFrom (input: DaemonConfig): Promise<Readonly<DaemonConfig>> {
  const { validateConfig } = await import('../daemon/node/index.ts')
  try {
    return validateConfig(input)
  } catch (err) {
    if ((err as { code?: string }).code === 'SHOAL_ERR_CONFIG') throw new ExitError((err as Error).message)
    throw err
  }
}

/** `--kv-cache-mb N` → a whole number of MiB (validated again, by key, in the daemon config). */
export function parseKvCacheMb (value: string | undefined): number | undefined {
  if (value === undefined) return undefined
  const n = Number(value)
  if (value.trim() === '' || !Number.isSafeInteger(n) || n < 0) throw new ExitError(`--kv-cache-mb: expected a whole number of MiB (0: no prefix reuse), got "${value}"`)
  return n
}

/** Start failures with a typed code (bad identity, bad model dir, port in use…) are one-liners too. */
export function startFailure (err: unknown): never {
  const code = (err as { code?: string }).code
  if (typeof code === 'string' && code.startsWith('SHOAL_ERR_')) throw new ExitError((err as Error).message)
  if (code === 'EADDRINUSE') throw new ExitError(`address in use: ${(err as Error).message}`)
  throw err
}

/** `--tls-cert` / `--tls-key` as the config's `tls` (validateConfig says which one is missing). */
export function tlsOf (opts: { tlsCert?: string, tlsKey?: string }): { tls?: { certFile: string, keyFile: string } } {
  if (opts.tlsCert === undefined && opts.tlsKey === undefined) return {}
  return { tls: { certFile: opts.tlsCert ?? '', keyFile: opts.tlsKey ?? '' } }
}
