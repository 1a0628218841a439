/** Where shoal keeps generated models and compiled shards: $SHOAL_CACHE, else $XDG_CACHE_HOME/shoal, else ~/.cache/shoal. */
import { homedir } from 'node:os'
import { join } from 'node:path'

export function cacheRoot (): string {
  const explicit = process.env.SHOAL_CACHE
  if (explicit !== undefined && explicit !== '') return explicit
  const xdg = process.env.XDG_CACHE_HOME
  return join(xdg !== undefined && xdg !== '' ? xdg : join(homedir(), '.cache'), 'shoal')
}
