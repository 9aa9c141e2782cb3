/* A form that came back with errors: its first invalid field gets the focus (and so comes
   into view), for keyboard and screen-reader users as for everyone else; else the part of
   the page that says why it was refused (an inbox row: data-refused). Without it the page
   opened at the top, with the error possibly thousands of pixels below. */
(function () {
  "use strict";
  function focusWhatWasRefused() {
    const field = document.querySelector('form [aria-invalid="true"]');
    if (field && typeof field.focus === "function") {
      field.focus();
      return;
    }
    const refused = document.querySelector("[data-refused]");
    if (refused) {
      refused.setAttribute("tabindex", "-1");
      refused.focus();
    }
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", focusWhatWasRefused);
  else focusWhatWasRefused();
})();
