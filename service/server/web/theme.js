"use strict";
// The pages' colour theme: the system's (prefers-color-scheme) until the person picks one with
// a page's #theme button; the pick is remembered per browser (localStorage) for every page.
// Loaded in <head>, so the theme is set before the first paint (no light flash in the dark).
(() => {
  const KEY = "pagechat.theme";
  const system = window.matchMedia("(prefers-color-scheme: dark)");
  const chosen = () => {
    try { return localStorage.getItem(KEY); } catch { return null; }
  };
  const current = () => chosen() || (system.matches ? "dark" : "light");
  const label = () => {
    const button = document.getElementById("theme");
    if (!button) return;
    const next = current() === "dark" ? "light" : "dark";
    button.textContent = next === "dark" ? "Dark" : "Light";
    button.title = `Switch to the ${next} theme (remembered in this browser)`;
  };
  const apply = () => {
    document.documentElement.dataset.theme = current();
    label();
  };
  apply();
  system.addEventListener("change", apply);
  document.addEventListener("DOMContentLoaded", () => {
    label();
    document.getElementById("theme")?.addEventListener("click", () => {
      try { localStorage.setItem(KEY, current() === "dark" ? "light" : "dark"); } catch { /* private mode */ }
      apply();
    });
  });
})();
